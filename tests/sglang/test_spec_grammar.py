"""Grammar-constrained requests under speculation (lynx_sglang.speculation.grammar and its use in
penalties.exact_rows / draft_row and the controller), in-process against SGLang's real xgrammar
backend (the embedded model's tokenizer, a regex grammar) and SamplingBatchInfo: a draft row is
what the draft step's masked sampler saw; each exact row is masked as exact decoding would mask
that position; and after verification the matcher stands where exact decoding leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_sglang.speculation import grammar as spec_grammar
from lynx_sglang.speculation import penalties, state
from lynx_sglang.speculation.state import SpecState
from lynx_sglang.speculation.verify import apply_acceptance, decide, sampler_rows

REGEX = r"(yes|no|maybe)! [a-z]{2,5}, [0-9]{3}\."


@pytest.fixture(scope="module")
def sgl(sglang_in_process, sglang_model):
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from transformers import AutoTokenizer

    override = get_context().override_server_args(device="cpu")
    override.install()
    tokenizer = AutoTokenizer.from_pretrained(sglang_model)
    vocab = len(tokenizer)
    backend = XGrammarGrammarBackend(tokenizer, vocab_size=vocab,
                                     model_eos_token_ids=[tokenizer.eos_token_id])
    yield SimpleNamespace(backend=backend, vocab=vocab, eos=tokenizer.eos_token_id,
                          SamplingBatchInfo=SamplingBatchInfo, SamplingParams=SamplingParams)
    override.restore()


class _Batch:
    def __init__(self, sgl, reqs):
        self.reqs, self.device = list(reqs), "cpu"
        self.sampling_info = sgl.SamplingBatchInfo.from_schedule_batch(self, sgl.vocab)
        self.multimodal_inputs = None


def _req(sgl, first_token: int):
    sp = sgl.SamplingParams(temperature=0.0)
    sp.verify(sgl.vocab)
    grammar = sgl.backend.dispatch_regex(REGEX)
    grammar.accept_token(first_token)  # what SGLang's prebuilt batch does with the first token
    return SimpleNamespace(
        rid="g", sampling_params=sp, output_ids=[first_token], grammar=grammar,
        eos_token_ids={sgl.eos}, return_logprob=False, return_hidden_states=False,
        tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=sgl.eos),
        custom_logit_processor=None, return_sampling_mask=False, sampling_logprobs_mode=None,
        multimodal_inputs=None)


def _sglang_masked(sgl, req, logits: torch.Tensor) -> torch.Tensor:
    """SGLang's decode step for one request: ForwardBatch sets the grammars, ModelRunner.sample
    fills the mask and transforms the logits."""
    info = _Batch(sgl, [req]).sampling_info.copy_for_forward()
    info.grammars = [req.grammar]
    info.update_regex_vocab_mask()
    out = logits[None].clone()
    info.apply_logits_bias(out)
    return out[0]


def _first_allowed(sgl) -> int:
    probe = sgl.backend.dispatch_regex(REGEX)
    mask = probe.allocate_vocab_mask(sgl.vocab, 1, "cpu")
    probe.fill_vocab_mask(mask, 0)
    row = torch.zeros(1, sgl.vocab)
    probe.apply_vocab_mask(row, mask)
    return int(row[0].argmax())


def _logits(sgl, steps: int, seed: int) -> torch.Tensor:
    return torch.randn(steps, sgl.vocab, generator=torch.Generator().manual_seed(seed))


def test_draft_row_is_the_masked_row_the_draft_step_sampled_from(sgl):
    req = _req(sgl, _first_allowed(sgl))
    raw = _logits(sgl, 4, seed=1)
    for step in range(4):
        info = _Batch(sgl, [req]).sampling_info.copy_for_forward()
        info.grammars = [req.grammar]  # the mask is not filled yet when the sampler hook runs
        ours = penalties.draft_row(info, raw[step][None], 0)
        theirs = _sglang_masked(sgl, req, raw[step])
        assert torch.equal(ours, theirs), step
        assert torch.isinf(ours).sum() > sgl.vocab // 2  # the grammar does constrain
        token = int(theirs.argmax())
        req.output_ids.append(token)
        req.grammar.accept_token(token)


def _speculate(sgl, anchor: torch.Tensor, n: int):
    """A request that speculated n greedy tokens on `anchor` rows, SGLang-style."""
    req = _req(sgl, _first_allowed(sgl))
    st = SpecState(room=1, logit_transforms=True,
                   grammar_base=len(req.grammar.accepted_tokens))
    for step in range(n):
        token = int(_sglang_masked(sgl, req, anchor[step]).argmax())
        req.output_ids.append(token)
        req.grammar.accept_token(token)
    return req, st


def _exact_decode(sgl, exact: torch.Tensor, n: int):
    """Exact greedy decoding with the grammar: its tokens and its matcher."""
    req = _req(sgl, _first_allowed(sgl))
    for step in range(n):
        token = int(_sglang_masked(sgl, req, exact[step]).argmax())
        req.output_ids.append(token)
        req.grammar.accept_token(token)
    return req


@pytest.mark.parametrize("diverge_at", [0, 3, None])
def test_verification_masks_each_position_and_leaves_the_matcher_at_the_verified_output(
        sgl, diverge_at):
    """Drafts from Anchor rows that agree with the exact rows until `diverge_at` (None: never):
    verification keeps exactly the drafts exact decoding would emit, adds its next token, and
    the matcher then equals one that saw only the verified output (same accepted tokens, same
    next mask)."""
    n = 6
    exact = _logits(sgl, n + 1, seed=7)
    anchor = exact.clone()
    if diverge_at is not None:
        anchor[diverge_at:] = _logits(sgl, n + 1 - diverge_at, seed=8)
    req, st = _speculate(sgl, anchor, n)
    reference = _exact_decode(sgl, exact, n + 1)
    rows = sampler_rows(req, st, exact)
    # Each row as exact decoding masked it, up to the first rejected draft.
    kept = n if diverge_at is None else diverge_at
    for i in range(kept + 1):
        prefix = _exact_decode(sgl, exact, i)
        assert torch.equal(rows[i], _sglang_masked(sgl, prefix, exact[i])), i
    acc = decide(req, st, rows)
    apply_acceptance(req, st, acc)
    spec_grammar.resync(req, st.grammar_base, st.verified_len)
    assert req.output_ids == reference.output_ids[: len(req.output_ids)]
    assert len(req.output_ids) == kept + 2  # the first token, the kept drafts, the next token
    assert req.grammar.accepted_tokens == req.output_ids
    probe = _exact_decode(sgl, exact, kept + 1)
    assert torch.equal(_sglang_masked(sgl, req, exact[0]), _sglang_masked(sgl, probe, exact[0]))


def test_grammar_requests_speculate_other_backends_wait(sgl):
    req = _req(sgl, _first_allowed(sgl))
    assert state.not_speculable_reason(req) is None
    req.grammar = SimpleNamespace(accept_token=lambda t: None)  # no rollback
    assert "without rollback" in state.not_speculable_reason(req)


def test_rewind_refuses_a_matcher_behind_its_start(sgl):
    req = _req(sgl, _first_allowed(sgl))
    with pytest.raises(RuntimeError, match="fewer than"):
        spec_grammar.rewind(req, len(req.grammar.accepted_tokens) + 1)


def test_sampled_grammar_verification_keeps_p_and_q_masked(sgl):
    """Sampled (temperature 0.8) drafts with their draft rows as recorded: with exact rows equal
    to the Anchor's every draft is kept whatever the seed (p == q after masking), and with other
    exact rows every token verification emits is one the grammar allows at its position."""
    n = 4
    anchor = _logits(sgl, n + 1, seed=21) * 3
    exact = _logits(sgl, n + 1, seed=22) * 3
    for rows_exact, all_kept in ((anchor, True), (exact, False)):
        for seed in range(6):
            req = _req(sgl, _first_allowed(sgl))
            req.sampling_params = sgl.SamplingParams(temperature=0.8)
            req.sampling_params.verify(sgl.vocab)
            st = SpecState(room=seed, sampled=True, logit_transforms=True,
                           grammar_base=len(req.grammar.accepted_tokens))
            gen = torch.Generator().manual_seed(seed)
            for step in range(n):
                info = _Batch(sgl, [req]).sampling_info.copy_for_forward()
                info.grammars = [req.grammar]
                row = penalties.draft_row(info, anchor[step][None], 0)
                st.draft_logits.append(row)
                token = int(torch.multinomial(torch.softmax(row / 0.8, -1), 1, generator=gen))
                req.output_ids.append(token)
                req.grammar.accept_token(token)
            torch.manual_seed(seed)
            rows = sampler_rows(req, st, rows_exact)
            acc = decide(req, st, rows)
            if all_kept:
                assert acc.accepted == n, seed
            apply_acceptance(req, st, acc)
            # Every emitted token passes the grammar (accept_token raises otherwise).
            spec_grammar.resync(req, st.grammar_base, st.verified_len)
            assert req.grammar.accepted_tokens == req.output_ids
