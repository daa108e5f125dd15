"""Speculation under top-k/top-p/min-p (lynx_sglang.upstream.sampling_filter and its use in
verify.decide): the filtered rows are exactly what SGLang's own torch sampler draws from, and
speculative sampling on filtered p and q emits exactly the filtered p."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_sglang.speculation import state
from lynx_sglang.speculation.acceptance import accept_sampled
from lynx_sglang.upstream.sampling_filter import FILTERING_BACKEND, filter_probs

VOCAB = 12
# (top_k, top_p, min_p): each filter alone, together, top_k past the vocabulary, and none.
PARAMS = [(3, 1.0, 0.0), (1 << 30, 0.7, 0.0), (1 << 30, 1.0, 0.2), (5, 0.8, 0.1),
          (VOCAB + 5, 0.9, 0.0), (1 << 30, 1.0, 0.0)]


def _rows() -> torch.Tensor:
    """Probability rows of crafted logits: random, and ties at the top-k/top-p boundaries."""
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(4, VOCAB, generator=gen) * 2
    ties = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 0.0] + [-1.0] * (VOCAB - 6),
                         [0.5] * VOCAB,
                         [3.0, 3.0, 1.0, 1.0] + [0.0] * (VOCAB - 4)])
    return torch.softmax(torch.cat([random, ties]), dim=-1)


@pytest.fixture(scope="module")
def sglang_filter(sglang_in_process):
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    def rows_sglang_draws_from(probs, top_k, top_p, min_p):
        n = probs.shape[0]
        _, kept, idx, _ = top_k_top_p_min_p_sampling_from_probs_torch(
            probs.clone(), torch.full((n,), top_k), torch.full((n,), top_p),
            torch.full((n,), min_p), min_p > 0, None, torch.zeros(n, dtype=torch.long),
            return_filtered_probs=True)
        return torch.zeros_like(kept).scatter_(-1, idx.long(), kept)

    return top_k_top_p_min_p_sampling_from_probs_torch, rows_sglang_draws_from


@pytest.mark.parametrize("params", PARAMS)
def test_filter_keeps_what_sglangs_sampler_keeps(sglang_filter, params):
    _, rows_sglang_draws_from = sglang_filter
    probs = _rows()
    ours = filter_probs(probs.clone(), *params)
    theirs = rows_sglang_draws_from(probs, *params).double()
    assert torch.equal(ours > 0, theirs > 0), params
    torch.testing.assert_close(ours, theirs / theirs.sum(-1, keepdim=True), rtol=0, atol=1e-7)
    assert torch.allclose(ours.sum(-1), torch.ones(len(probs), dtype=torch.float64))


def test_filter_matches_sglangs_sampling_frequencies(sglang_filter):
    """SGLang's sampler itself (torch.multinomial on its unnormalized rows), 40k draws of one
    row: the frequencies fit the filtered row (chi-square, 0.1%)."""
    sample, _ = sglang_filter
    top_k, top_p, min_p = 6, 0.85, 0.05
    row = _rows()[1:2]
    n = 40_000
    torch.manual_seed(5)
    ids = sample(row.repeat(n, 1), torch.full((n,), top_k), torch.full((n,), top_p),
                 torch.full((n,), min_p), True, None, torch.zeros(n, dtype=torch.long))
    counts = torch.bincount(ids.long(), minlength=VOCAB).double()
    expected = filter_probs(row.clone(), top_k, top_p, min_p)[0] * n
    support = expected > 0
    assert (counts[~support] == 0).all()
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    df = int(support.sum()) - 1
    assert 1 <= df <= 5 and chi2 < 20.52, (chi2, df)  # 20.52: 0.1% critical value at df 5


@pytest.mark.parametrize("params", PARAMS)
def test_acceptance_on_filtered_rows_emits_exactly_the_filtered_target(params):
    """Exact computation, per target row: P(emit x) = q'(x) min(1, p'(x)/q'(x)) + (rejection
    mass) * norm(max(0, p' - q'))(x) equals p'(x)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, VOCAB, generator=gen) * 2
    p, q = (filter_probs(torch.softmax(r[None], -1), *params)[0].double() for r in logits)
    accepted = torch.where(q > 0, torch.minimum(q, p), torch.zeros_like(q))
    residual = (p - q).clamp(min=0)
    emitted = accepted + (1 - accepted.sum()) * residual / residual.sum()
    torch.testing.assert_close(emitted, p, rtol=0, atol=1e-6)


def test_accept_sampled_on_filtered_rows_never_emits_a_filtered_token():
    """Drafts drawn from a filtered q, checked against a p whose filter cuts other tokens: every
    emitted token is in p's support, and the frequencies fit p (chi-square, 0.1%)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, VOCAB, generator=gen) * 2
    p, q = (filter_probs(torch.softmax(r[None], -1), 4, 0.9, 0.05) for r in logits)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    trials = 6000
    for _ in range(trials):
        draft = int(torch.multinomial(q[0].float(), 1, generator=gen))
        result = accept_sampled(p, q, [draft], gen)
        counts[draft if result.accepted == 1 else result.next_token] += 1
    support = p[0] > 0
    assert (counts[~support] == 0).all()
    expected = p[0][support] * trials
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, counts  # df <= 3 (top_k 4): 0.1% critical value


def test_decide_filters_exact_and_draft_rows_with_the_requests_parameters(sglang_in_process):
    """A draft the exact filtered row never emits (ranked 2nd, top_k 1 cut) is always rejected,
    and its replacement is the only token p' keeps."""
    from lynx_sglang.speculation.state import SpecState
    from lynx_sglang.speculation.verify import decide

    exact = torch.tensor([[4.0, 3.9, 0.0, 0.0]])
    draft = torch.tensor([0.0, 4.0, 0.0, 0.0])
    sp = SimpleNamespace(temperature=1.0, top_k=1 << 30, top_p=0.3, min_p=0.0, sampling_seed=7,
                         frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                         logit_bias=None, min_new_tokens=0)
    req = SimpleNamespace(sampling_params=sp, output_ids=[5, 1], rid="r")
    st = SpecState(room=1, sampled=True)
    st.draft_logits = [draft]
    for _ in range(20):
        acc = decide(req, st, exact)
        assert (acc.accepted, acc.next_token) == (0, 0)


def test_decide_divides_by_temperature_as_sglangs_sampler_does(sglang_in_process):
    """The same float32 division and softmax as Sampler.forward: bit-identical rows, so a filter
    cuts at the same token."""
    from sglang.kernels.ops import sampling as sampling_ops

    from lynx_sglang.speculation.verify import _sampler_probs

    # SGLang's kernel op from 0.5.22; 0.5.21's Sampler.forward calls torch.softmax itself.
    sampler_softmax = getattr(sampling_ops, "softmax", lambda x: torch.softmax(x, dim=-1))

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 3
    sp = SimpleNamespace(temperature=0.7, top_k=1 << 30, top_p=1.0, min_p=0.0)
    theirs = logits.clone()
    theirs.div_(torch.tensor([[0.7]] * 3, dtype=torch.float32))
    assert torch.equal(_sampler_probs(logits, sp), sampler_softmax(theirs))


def _req(**params) -> SimpleNamespace:
    sp = dict(temperature=0.8, top_k=1 << 30, top_p=1.0, min_p=0.0, frequency_penalty=0.0,
              presence_penalty=0.0, repetition_penalty=1.0, logit_bias=None, min_new_tokens=0)
    sp.update(params)
    return SimpleNamespace(sampling_params=SimpleNamespace(**sp), return_logprob=False,
                           grammar=None, return_hidden_states=False, custom_logit_processor=None)


def test_truncated_sampling_speculates_only_on_the_torch_sampler(monkeypatch):
    monkeypatch.setattr(state, "_sampling_backend", lambda: FILTERING_BACKEND)
    for params in ({"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1}):
        assert state.not_speculable_reason(_req(**params)) is None, params
    # Everything else that must wait still does.
    assert state.not_speculable_reason(_req(top_p=0.9, custom_params={"x": 1})) is not None
    monkeypatch.setattr(state, "_sampling_backend", lambda: "flashinfer")
    assert state.not_speculable_reason(_req(top_k=20)) == "sampled with top-k/top-p/min-p"
    assert state.not_speculable_reason(_req()) is None


def test_sample_before_turns_off_sglangs_topk_shortcut_for_speculating_rows(monkeypatch,
                                                                           standin_release):
    """The draft rows must be cut as `filter_probs` cuts them: SGLang's full-sort path (in a
    release with the topk shortcut: `standin_release` is 0.5.23's layout)."""
    from lynx_sglang.speculation import hooks

    recorded = []
    ctl = SimpleNamespace(sampled_by_pool_idx={3: object()},
                          record_draft_logits=lambda rows, logits, info: recorded.append(rows))
    monkeypatch.setattr(hooks, "_spec", lambda rt: ctl)
    monkeypatch.setattr(hooks.runtime, "of_kv_pool", lambda pool: None)

    def batch(rows):
        return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: True),
                               req_pool_indices=torch.tensor(rows),
                               sampling_info=SimpleNamespace(max_top_k=20))

    runner, logits = SimpleNamespace(token_to_kv_pool=None), SimpleNamespace(next_token_logits=0)
    other, speculating = batch([1, 2]), batch([1, 3])
    hooks.sample_before(runner, logits, other)
    hooks.sample_before(runner, logits, speculating)
    assert (other.sampling_info.max_top_k, speculating.sampling_info.max_top_k) == (20, None)
    assert recorded == [[1, 2], [1, 3]]
