"""Penalties, logit bias and min_new_tokens under speculation (lynx_sglang.speculation.penalties
and its use in verify.decide / the controller), in-process against SGLang's real
SamplingBatchInfo and penalizer classes: the exact rows verification builds are, position by
position, the logits SGLang's decode would sample from; a draft row is what the draft step
sampled from; and a verified request resumes with the penalty state it would have had if the
rolled-back tokens had never been generated."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_sglang.speculation import penalties, state
from lynx_sglang.speculation.state import SpecState
from lynx_sglang.speculation.verify import decide, sampler_rows

VOCAB = 16
EOS, STOP = 2, 7
# Each transformation alone, and all together.
PARAMS = [
    {"frequency_penalty": 0.7},
    {"presence_penalty": 0.9},
    {"repetition_penalty": 1.6},
    {"logit_bias": {"5": 1.5, "9": -2.0}},
    {"min_new_tokens": 4},
    {"frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.3,
     "logit_bias": {"4": 0.8}, "min_new_tokens": 3},
]


@pytest.fixture(scope="module")
def sgl(sglang_in_process):
    """SGLang's sampling classes, with a server config published (SamplingBatchInfo reads it)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    override = get_context().override_server_args(device="cpu")
    override.install()
    yield SimpleNamespace(ScheduleBatch=ScheduleBatch, SamplingBatchInfo=SamplingBatchInfo,
                          SamplingParams=SamplingParams)
    override.restore()


class _Batch:
    """What SGLang's SamplingBatchInfo, its penalizers and ScheduleBatch's
    cumulate_penalty_output_tokens read of a decode batch."""

    def __init__(self, sgl, reqs):
        self.reqs, self.device = list(reqs), "cpu"
        self.sampling_info = sgl.SamplingBatchInfo.from_schedule_batch(self, VOCAB)
        self.multimodal_inputs = None


def _req(sgl, output_ids, temperature=0.0, **params):
    sp = sgl.SamplingParams(temperature=temperature, stop_token_ids=[STOP], **params)
    sp.verify(VOCAB)
    return SimpleNamespace(
        sampling_params=sp, output_ids=list(output_ids), eos_token_ids={EOS},
        tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS),
        custom_logit_processor=None, return_sampling_mask=False, sampling_logprobs_mode=None,
        multimodal_inputs=None, grammar=None)


def _raw_logits(steps: int, rows: int, seed: int) -> torch.Tensor:
    """[steps, rows, VOCAB] logits peaked on a few tokens, EOS and the stop token among them, so
    that greedy decoding repeats tokens and would stop early without min_new_tokens."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(steps, rows, VOCAB, generator=gen)
    raw[..., [EOS, STOP, 4, 5, 9]] += torch.tensor([3.0, 2.5, 3.5, 3.2, 2.8])
    return raw


def _sglang_decode(sgl, batch: _Batch, raw: torch.Tensor, forced: list | None = None,
                   overlap: bool = False, cumulate=None):
    """SGLang's decode steps over `raw` ([steps, rows, VOCAB]): prepare_for_decode feeds each
    request's last output token to the penalizers, the forward's copy of the sampling info
    transforms the logits, greedy picks (or `forced[step][row]`, unless `forced[step]` is None)
    are appended. Returns the
    transformed logits per step and the forward copies. `overlap`: as SGLang's overlap event
    loop orders it, each step is prepared before the previous step's tokens are appended (the
    last step's are appended at the end). `cumulate`: the function feeding the penalizers
    (default SGLang's `cumulate_penalty_output_tokens`)."""
    cumulate = cumulate or sgl.ScheduleBatch.cumulate_penalty_output_tokens
    processed, forward_infos, pending = [], [], None

    def append(tokens):
        for req, token in zip(batch.reqs, tokens, strict=True):
            req.output_ids.append(token)

    for step in range(raw.shape[0]):
        if batch.sampling_info.penalizer_orchestrator.is_required:
            cumulate(batch)
        if pending is not None:  # the previous step's result, processed after this launch
            append(pending)
            pending = None
        info = batch.sampling_info.copy_for_forward()
        logits = raw[step].clone()
        info.apply_logits_bias(logits)
        processed.append(logits)
        forward_infos.append(info)
        tokens = [forced[step][row] if forced and forced[step] is not None
                  else int(logits[row].argmax()) for row in range(len(batch.reqs))]
        if overlap:
            pending = tokens
        else:
            append(tokens)
    if pending is not None:
        append(pending)
    return torch.stack(processed), forward_infos


@pytest.mark.parametrize("params", PARAMS)
def test_exact_rows_are_sglangs_transformed_logits_at_every_position(sgl, params):
    steps = 7
    target = _req(sgl, [4], **params)
    # A batch neighbour with other parameters: its row must not leak into the target's.
    other = _req(sgl, [5], frequency_penalty=1.1, logit_bias={"3": 4.0})
    raw = _raw_logits(steps, 2, seed=len(str(params)))
    processed, _ = _sglang_decode(sgl, _Batch(sgl, [target, other]), raw)
    assert not torch.allclose(processed[:, 0], raw[:, 0]), "the parameters changed nothing"
    # Verification sees output t0..t6 (6 speculative tokens) and 7 rows: the last is the bonus.
    verified = _req(sgl, target.output_ids[:steps], **params)
    ours = penalties.exact_rows(verified, raw[:, 0], start=1)
    torch.testing.assert_close(ours, processed[:, 0], rtol=0, atol=1e-6)
    if "min_new_tokens" in params:
        masked = torch.isinf(processed[:, 0, EOS])
        assert masked.any() and not masked.all()  # the mask lifts at min_new_tokens


@pytest.mark.parametrize("params", PARAMS)
def test_draft_row_is_what_the_draft_step_sampled_from(sgl, params):
    target = _req(sgl, [4], temperature=0.8, **params)
    other = _req(sgl, [9], repetition_penalty=2.0)
    raw = _raw_logits(5, 2, seed=7)
    processed, infos = _sglang_decode(sgl, _Batch(sgl, [other, target]), raw)
    for step, info in enumerate(infos):
        for row in range(2):
            torch.testing.assert_close(penalties.draft_row(info, raw[step], row),
                                       processed[step, row], rtol=0, atol=0)


def _penalty_state(batch: _Batch, row: int) -> dict:
    return {f"{type(p).__name__}.{name}": value[row].clone()
            for p in batch.sampling_info.penalizer_orchestrator.penalizers.values()
            if p.is_prepared()
            for name, value in vars(p).items() if isinstance(value, torch.Tensor)}


def test_resumed_penalty_state_equals_one_that_never_saw_the_rolled_back_tokens(sgl):
    params = dict(frequency_penalty=0.5, presence_penalty=0.4, repetition_penalty=1.5,
                  min_new_tokens=6, logit_bias={"4": 1.0})
    t0, drafts, correction = 4, [5, 9, 5, 4], 11
    running = _Batch(sgl, [_req(sgl, [t0], **params), _req(sgl, [3])])
    spec_req = running.reqs[0]
    _sglang_decode(sgl, running, _raw_logits(4, 2, seed=1),
                   forced=[[d, 1] for d in drafts])
    speculated = _penalty_state(running, 0)
    # Verification kept the first draft and corrected the second: output t0, d1, correction.
    del spec_req.output_ids[2:]
    spec_req.output_ids.append(correction)
    plain = _req(sgl, [3, 1, 1], temperature=0.7)
    scheduler = SimpleNamespace(_build_hisparse_decode_batch=lambda reqs: _Batch(sgl, reqs))
    batches = penalties.resume_batches(scheduler, [plain, spec_req])
    assert [b.reqs for b in batches] == [[plain], [spec_req]]
    resumed = batches[1]
    sgl.ScheduleBatch.cumulate_penalty_output_tokens(resumed)  # the next prepare_for_decode
    # The same request decoded without ever generating the rolled-back drafts.
    never = _Batch(sgl, [_req(sgl, [t0], **params)])
    _sglang_decode(sgl, never, _raw_logits(2, 1, seed=2), forced=[[drafts[0]], [correction]])
    assert never.reqs[0].output_ids == spec_req.output_ids
    sgl.ScheduleBatch.cumulate_penalty_output_tokens(never)
    expected = _penalty_state(never, 0)
    got = _penalty_state(resumed, 0)
    assert expected.keys() == got.keys() and len(expected) >= 7, expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(speculated[n], expected[n]) for n in expected)
    # And the next step samples from the same logits.
    raw = _raw_logits(1, 1, seed=3)[0]
    a, b = raw.clone(), raw.clone()
    resumed.sampling_info.copy_for_forward().apply_logits_bias(a)
    never.sampling_info.copy_for_forward().apply_logits_bias(b)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_greedy_verification_takes_the_argmax_after_penalties(sgl):
    """Drafts decoded greedily with a frequency penalty on logits that favour one token: the
    penalties moved the argmax, and verification on the same logits keeps every draft."""
    params = dict(frequency_penalty=2.0, min_new_tokens=3)
    steps = 6
    raw = torch.zeros(steps + 1, 1, VOCAB)
    raw[..., 5] = 4.0
    raw[..., EOS] = 6.0
    raw[..., 9] = 3.0
    spec = _req(sgl, [4], **params)
    _sglang_decode(sgl, _Batch(sgl, [spec]), raw[:steps])
    drafts = spec.output_ids[1:]
    # The raw argmax is EOS everywhere: the mask and the penalty chose the first two.
    assert drafts[:2] == [5, 9] and EOS in drafts, drafts
    req = _req(sgl, spec.output_ids, **params)
    st = SpecState(room=1)
    acc = decide(req, st, sampler_rows(req, st, raw[:, 0]))
    assert acc.accepted == steps
    assert acc.next_token == int(penalties.exact_rows(req, raw[:, 0], 1)[-1].argmax())


def test_sampled_verification_uses_transformed_p_and_q(sgl):
    """A sampled request whose draft rows were recorded after the transformations and whose
    exact logits equal the draft's: p == q, so every draft is kept whatever the seed."""
    params = dict(repetition_penalty=1.8, presence_penalty=0.6, logit_bias={"9": 2.0})
    raw = _raw_logits(5, 1, seed=5)
    spec = _req(sgl, [4], temperature=0.9, **params)
    gen = torch.Generator().manual_seed(0)
    batch = _Batch(sgl, [spec])
    draft_rows = []
    for step in range(4):
        if batch.sampling_info.penalizer_orchestrator.is_required:
            sgl.ScheduleBatch.cumulate_penalty_output_tokens(batch)
        info = batch.sampling_info.copy_for_forward()
        row = penalties.draft_row(info, raw[step], 0)
        draft_rows.append(row)
        probs = torch.softmax(row / 0.9, -1)
        spec.output_ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    req = _req(sgl, spec.output_ids, temperature=0.9, **params)
    req.sampling_params.sampling_seed = None
    for seed in range(20):
        torch.manual_seed(seed)
        st = SpecState(room=seed, sampled=True, logit_transforms=True, draft_logits=draft_rows)
        assert decide(req, st, sampler_rows(req, st, raw[:, 0])).accepted == 4


def test_penalties_speculate_custom_processors_do_not(sgl):
    def reason(**params):
        sp = SimpleNamespace(temperature=0.7, top_k=1 << 30, top_p=1.0, min_p=0.0,
                             frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                             logit_bias=None, min_new_tokens=0)
        vars(sp).update(params)
        return state.not_speculable_reason(SimpleNamespace(
            sampling_params=sp, return_logprob=False, grammar=None, return_hidden_states=False,
            custom_logit_processor=None))

    for params in PARAMS:
        assert reason(**params) is None, params
    assert reason(custom_params={"x": 1}) == "a custom logit processor or custom parameters"
    # What SGLang's chat endpoint adds for a reasoning model does not stop speculation.
    assert reason(custom_params={"__sglang_reasoning_end_token_ids": [7]}) is None
    assert reason(custom_params={"__sglang_reasoning_end_token_ids": [7], "x": 1}) is not None


def test_sglangs_own_custom_params_keys_carry_the_private_prefix(sgl):
    """The keys SGLang itself puts into custom_params are recognised by their prefix: a new
    SGLang that renamed them would otherwise silently stop reasoning models' speculation."""
    from sglang.srt.sampling import sampling_params

    for key in (sampling_params.REQUEST_REASONING_END_TOKEN_IDS_KEY,
                sampling_params.REQUEST_REASONING_IN_GRAMMAR_KEY):
        assert key.startswith(state.SGLANG_PRIVATE_PARAM), key


@pytest.mark.parametrize("params", PARAMS)
def test_exact_rows_follow_the_overlap_schedules_late_feed(sgl, params):
    """Under the overlap schedule SGLang prepares step k before it has appended step k-1's token:
    the exact rows must be transformed with that state ([t0, t0, t1, ..., t(k-2)]), not the
    non-overlap one (the two differ, or this would prove nothing)."""
    steps = 7
    target = _req(sgl, [4], **params)
    other = _req(sgl, [5], frequency_penalty=1.1, logit_bias={"3": 4.0})
    raw = _raw_logits(steps, 2, seed=len(str(params)) + 1)
    processed, _ = _sglang_decode(sgl, _Batch(sgl, [target, other]), raw, overlap=True)
    verified = _req(sgl, target.output_ids[:steps], **params)
    ours = penalties.exact_rows(verified, raw[:, 0], start=1, overlap=True)
    torch.testing.assert_close(ours, processed[:, 0], rtol=0, atol=1e-6)
    # Logit bias and min_new_tokens (a count, k either way) do not depend on the feed order.
    if {"frequency_penalty", "presence_penalty", "repetition_penalty"} & set(params):
        assert not torch.equal(penalties.exact_rows(verified, raw[:, 0], start=1), ours)


def test_a_request_resumed_under_overlap_goes_on_as_one_that_never_paused(sgl):
    """After verification under the overlap schedule a resumed request's first step has nothing
    in flight, so SGLang would feed its last token where an uninterrupted request feeds the one
    before: seed_penalties and the cumulate hook make every later step's logits equal those of a
    request that decoded the verified tokens straight through."""
    params = dict(frequency_penalty=0.5, presence_penalty=0.4, repetition_penalty=1.5,
                  min_new_tokens=7, logit_bias={"4": 1.0})
    t0, verified, free = 4, [5, 9, 11, 5], 4
    raw = _raw_logits(len(verified) + free, 1, seed=9)
    # Never paused: the verified tokens (forced), then free greedy steps, one pipeline.
    never = _Batch(sgl, [_req(sgl, [t0], **params)])
    expected, _ = _sglang_decode(sgl, never, raw, overlap=True,
                                 forced=[[t] for t in verified] + [None] * free)
    assert never.reqs[0].output_ids[:len(verified) + 1] == [t0, *verified]
    # Resumed: a fresh one-request batch as resume_batches builds it, then the same free steps.
    scheduler = SimpleNamespace(_build_hisparse_decode_batch=lambda reqs: _Batch(sgl, reqs))
    req = _req(sgl, [t0, *verified], **params)
    (resumed,) = penalties.resume_batches(scheduler, [req], overlap=True)
    assert getattr(req, penalties.RESUME_FEED_ATTR) == verified[-2]

    def hooked(batch):
        return penalties.cumulate_penalty_output_tokens_around(
            sgl.ScheduleBatch.cumulate_penalty_output_tokens, batch)

    got, _ = _sglang_decode(sgl, resumed, raw[len(verified):], overlap=True, cumulate=hooked)
    torch.testing.assert_close(got[:, 0], expected[len(verified):, 0], rtol=0, atol=0)
    assert req.output_ids == never.reqs[0].output_ids
    assert not hasattr(req, penalties.RESUME_FEED_ATTR)  # fed once
    # Without the hook's substitution the resumed request goes another way (its point).
    other = _req(sgl, [t0, *verified], **params)
    (plain,) = penalties.resume_batches(scheduler, [other], overlap=True)
    delattr(other, penalties.RESUME_FEED_ATTR)
    unhooked, _ = _sglang_decode(sgl, plain, raw[len(verified):], overlap=True)
    assert not torch.equal(unhooked[:, 0], expected[len(verified):, 0])
