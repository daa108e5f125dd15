"""Logprobs under speculation (lynx_sglang.upstream.logprob_layout), in-process against SGLang's real
Sampler, SamplingParams, SamplingBatchInfo and ReqLogprob: the logprobs verification writes for a
verified token are the ones SGLang's decode step would have returned from the same (exact) logits,
whatever the batch's sampling mode, and every speculative (Anchor) entry past the verified prefix
is replaced or dropped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_sglang.speculation import state
from lynx_sglang.speculation.state import SpecState
from lynx_sglang.speculation.verify import apply_acceptance, decide, sampler_rows
from lynx_sglang.upstream import adapter as upstream_adapter
from lynx_sglang.upstream import logprob_layout as logprobs

VOCAB = 40
TOP = 4
IDS = [3, 7, 11]


@pytest.fixture(scope="module")
def sgl(sglang_in_process):
    """SGLang's sampling classes with a server config published, and a Sampler built without a TP
    group (this process has none; a single rank never syncs token ids without a grammar)."""
    from sglang.srt.layers import sampler as sampler_module
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ReqLogprob
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams

    override = get_context().override_server_args(device="cpu", sampling_backend="pytorch")
    override.install()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler_module, "get_parallel",
                   lambda: SimpleNamespace(tp_group=SimpleNamespace(device_group=None)))
        mp.setattr(sampler_module, "is_dp_attention_enabled", lambda: False)
        yield SimpleNamespace(sampler=sampler_module.Sampler(), Output=LogitsProcessorOutput,
                              ReqLogprob=ReqLogprob, SamplingBatchInfo=SamplingBatchInfo,
                              SamplingParams=SamplingParams)
    override.restore()


def _req(sgl, output_ids, *, top=TOP, token_ids=IDS, **params):
    sp = sgl.SamplingParams(**params)
    sp.verify(VOCAB)
    lp = sgl.ReqLogprob(top_logprobs_num=top, token_ids_logprob=token_ids)
    for name in logprobs._OUTPUT_LISTS:
        setattr(lp, name, [])
    return SimpleNamespace(
        rid="r", sampling_params=sp, output_ids=list(output_ids), logprob=lp, return_logprob=True,
        eos_token_ids={2}, tokenizer=SimpleNamespace(additional_stop_token_ids=None,
                                                     eos_token_id=2),
        custom_logit_processor=None, return_sampling_mask=False, sampling_logprobs_mode=None,
        multimodal_inputs=None, grammar=None, return_hidden_states=False)


class _Batch:
    def __init__(self, sgl, reqs):
        self.reqs, self.device = list(reqs), "cpu"
        self.sampling_info = sgl.SamplingBatchInfo.from_schedule_batch(self, VOCAB)
        self.multimodal_inputs = None


def _sglang_step(sgl, reqs, logits: torch.Tensor) -> SimpleNamespace:
    """One SGLang decode step's sampler over `logits` [len(reqs), VOCAB]: the tokens it drew and
    the logprobs it returned per request (token, top-k, requested ids)."""
    info = _Batch(sgl, reqs).sampling_info.copy_for_forward()
    out = sgl.Output(next_token_logits=logits.clone())
    ids = sgl.sampler.forward(out, info, True, [r.logprob.top_logprobs_num for r in reqs],
                              [r.logprob.token_ids_logprob for r in reqs],
                              positions=torch.zeros(len(reqs), dtype=torch.int64))
    return SimpleNamespace(ids=ids.tolist(), token=out.next_token_logprobs.tolist(),
                           top_val=[v.tolist() for v in out.next_token_top_logprobs_val],
                           top_idx=[i.tolist() for i in out.next_token_top_logprobs_idx],
                           ids_val=[v.tolist() for v in out.next_token_token_ids_logprobs_val])


def _ours(sgl, req, row: torch.Tensor, token: int, greedy: bool) -> SimpleNamespace:
    """What `replace_speculative_logprobs` writes for one verified `token` predicted by `row`."""
    probe = _req(sgl, [0, token], top=req.logprob.top_logprobs_num,
                 token_ids=req.logprob.token_ids_logprob,
                 temperature=req.sampling_params.temperature)
    logprobs.replace_speculative_logprobs(probe, 1, row[None], greedy)
    lp = probe.logprob
    return SimpleNamespace(token=lp.output_token_logprobs_val, idx=lp.output_token_logprobs_idx,
                           top_val=lp.output_top_logprobs_val, top_idx=lp.output_top_logprobs_idx,
                           ids_val=lp.output_token_ids_logprobs_val)


@pytest.mark.parametrize("mix", ["all-greedy", "all-sampled", "mixed"])
def test_verified_logprobs_are_what_sglangs_sampler_returns(sgl, mix):
    """Per request, whatever else shares the batch: SGLang's sampler logprobs of the token it drew
    equal ours for that token from the same row (greedy requests in a sampled batch within float
    rounding: SGLang then takes log(softmax(x / 1)) instead of log_softmax(x))."""
    torch.manual_seed(0)
    temps = {"all-greedy": [0.0, 0.0], "all-sampled": [0.7, 1.3], "mixed": [0.0, 0.8]}[mix]
    reqs = [_req(sgl, [1], temperature=t, top_p=0.9 if t else 1.0) for t in temps]
    for step in range(5):
        logits = torch.randn(len(reqs), VOCAB) * 3
        theirs = _sglang_step(sgl, reqs, logits)
        for i, req in enumerate(reqs):
            greedy = state.is_greedy(req)
            ours = _ours(sgl, req, logits[i], theirs.ids[i], greedy)
            exact = mix != "mixed" or not greedy
            tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-5}
            torch.testing.assert_close(ours.token, [theirs.token[i]], **tol)
            assert ours.idx == [theirs.ids[i]]
            torch.testing.assert_close(ours.top_val, [theirs.top_val[i]], **tol)
            assert ours.top_idx == [theirs.top_idx[i]], (step, i)
            torch.testing.assert_close(ours.ids_val, [theirs.ids_val[i]], **tol)


def test_sampled_logprobs_use_the_temperature_not_the_filter(sgl):
    """A sampled request's logprob is log softmax(x / T) over the whole vocabulary: top-p cuts the
    sampler's copy, not what it returns (a wrong implementation taking the filtered row fails)."""
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    req = _req(sgl, [1], temperature=0.5, top_p=0.5)
    ours = _ours(sgl, req, row, int(row.argmax()), greedy=False)
    expected = torch.log_softmax(row / 0.5, -1)
    torch.testing.assert_close(ours.top_val[0], expected.topk(TOP).values.tolist(),
                               rtol=1e-5, atol=1e-5)


def test_verification_replaces_every_speculative_entry(sgl):
    """Three drafts with Anchor logprobs; the exact rows keep the first and correct the second:
    the lists end with the verified prefix's own entries, then exact entries for the kept draft
    and the correction, nothing of the rejected drafts; the layout is SGLang's (one entry per
    output token in every list the request asked for)."""
    exact = torch.full((4, VOCAB), -5.0)
    exact[0, 9], exact[1, 12], exact[2, 30], exact[3, 31] = 4.0, 4.0, 4.0, 4.0
    req = _req(sgl, [5, 9, 13, 14], temperature=0.0)
    lp = req.logprob
    # The first token's entries (from the prefill), then three Anchor-precision ones.
    lp.output_token_logprobs_val += [-0.1, -9.0, -9.0, -9.0]
    lp.output_token_logprobs_idx += [5, 9, 13, 14]
    lp.output_top_logprobs_val += [[-0.1]] + [[-9.0]] * 3
    lp.output_top_logprobs_idx += [[5]] + [[0]] * 3
    # The requested ids' lists: the commit's empty row for the first token where the release
    # reserves one (0.5.23, `upstream.adapter`), then three Anchor-precision ones.
    layout = upstream_adapter.scheduler()
    first = [[]] if layout.first_token_has_ids_logprob_row else []
    lp.output_token_ids_logprobs_val += first + [[-9.0] * 3] * 3
    lp.output_token_ids_logprobs_idx += first + [IDS] * 3
    st = SpecState(room=1)
    rows = sampler_rows(req, st, exact)
    result = apply_acceptance(req, st, decide(req, st, rows))
    assert (result.accepted, result.corrected_token) == (1, 12)
    logprobs.replace_speculative_logprobs(req, st.verified_len, rows, greedy=True)
    assert req.output_ids == [5, 9, 12]
    assert lp.output_token_logprobs_idx == [5, 9, 12]
    expected = torch.log_softmax(exact[:2], -1)
    assert lp.output_token_logprobs_val[0] == -0.1
    torch.testing.assert_close(lp.output_token_logprobs_val[1:],
                               [float(expected[0, 9]), float(expected[1, 12])])
    for name in logprobs._OUTPUT_LISTS:
        rows = layout.token_ids_logprob_rows(3) if name in logprobs._TOKEN_IDS_LISTS else 3
        assert len(getattr(lp, name)) == rows, name
    assert lp.output_top_logprobs_idx[1][0] == 9 and lp.output_top_logprobs_idx[2][0] == 12
    torch.testing.assert_close(lp.output_token_ids_logprobs_val[-1],
                               expected[1, IDS].tolist())


def test_a_request_without_top_or_id_logprobs_keeps_sglangs_layout(sgl):
    """top_logprobs_num 0 and no token ids: SGLang's decode appends nothing to those lists (only
    the commit's first entry is there), so neither does verification."""
    req = _req(sgl, [5, 9], top=0, token_ids=None, temperature=0.0)
    lp = req.logprob
    lp.output_top_logprobs_val.append([])
    lp.output_top_logprobs_idx.append([])
    lp.output_token_logprobs_val += [-0.1, -3.0]
    lp.output_token_logprobs_idx += [5, 9]
    logprobs.replace_speculative_logprobs(req, 1, torch.randn(2, VOCAB), greedy=True)
    assert len(lp.output_token_logprobs_val) == 2 and lp.output_top_logprobs_val == [[]]
    assert lp.output_token_ids_logprobs_val == []


def test_an_abort_drops_the_speculative_entries(sgl):
    req = _req(sgl, [5], temperature=0.0)
    req.logprob.output_token_logprobs_val += [-0.1, -2.0, -3.0]
    logprobs.truncate_logprobs(req, 1)
    assert req.logprob.output_token_logprobs_val == [-0.1]


def test_logprob_requests_speculate():
    req = SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0, top_k=1, top_p=1.0,
                                                          min_p=0.0),
                          return_logprob=True, grammar=None, return_hidden_states=False,
                          custom_logit_processor=None)
    assert state.not_speculable_reason(req) is None
