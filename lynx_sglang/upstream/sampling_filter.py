"""The distribution SGLang's sampler really draws a token from under top-k, top-p and min-p: the
temperature softmax filtered as SGLang's torch sampler filters it, renormalized.

Copied SGLang logic (`hook_table.COPIED`, fingerprinted per release): it lives in the SGLang room
because it must track SGLang's sampler release by release. Called by `speculation.verify.decide` for
both the exact rows (p) and the draft rows (q) of a sampled request, with the request's own
parameters, so that speculative sampling on the filtered rows
(`speculation.acceptance.accept_sampled`) emits exactly what exact decoding would draw.
`speculation.state.not_speculable_reason` lets truncated sampling speculate only where SGLang
samples with this torch path (`FILTERING_BACKEND`).

The transformation is `sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch`
(SGLang 0.5.23), step for step on the same float32 probabilities: sort descending; cumulative sum
of the sorted row; zero ranks >= top_k; zero ranks whose preceding mass (cumsum - p) exceeds top_p
(the cumsum is taken before the top-k zeroing); zero probabilities below min_p times the largest;
`torch.multinomial` on what is left, i.e. the row renormalized. A request with any of the three
filters always takes that path whatever its batch holds, and every step is per row, so its
distribution depends on its own parameters only (ties aside: see `filter_probs`).
"""

from __future__ import annotations

import torch

# SGLang's `--sampling-backend` whose top-k/top-p/min-p semantics `filter_probs` reproduces.
# FlashInfer's fused kernels ("joint" top-k/top-p, renormalize-then-min-p) cut differently.
FILTERING_BACKEND = "pytorch"


def has_filter(top_k: int, top_p: float, min_p: float) -> bool:
    """Whether SGLang's sampler truncates a request with these parameters (top_k 1 is greedy and
    never sampled; SGLang stores "no top-k" as 1 << 30)."""
    return top_p < 1.0 or 1 < top_k < (1 << 30) or min_p > 0


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Rows [n, vocab] of temperature-softmax probabilities (float32, as SGLang's sampler has
    them) -> the float64 rows SGLang's torch sampler draws from. Without a filter these are the
    rows themselves: SGLang then samples them directly.

    Ties are cut as `Tensor.sort` orders them, as SGLang's full-sort path does. Its `torch.topk`
    shortcut (taken when every request of a batch has 1 <= top_k < 1 << 30) may keep other
    tokens tied at a cut (measured: a third of rows of bf16-rounded 32k-vocabulary logits at
    top_k 5-50), so `hooks.sample_before` turns it off for batches with speculating sampled
    requests; for the exact rows any of SGLang's tie orders is one SGLang itself may use."""
    if not has_filter(top_k, top_p, min_p):
        return probs.double()
    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    probs_sort[:, top_k:] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_p] = 0.0
    if min_p > 0:
        # SGLang skips this step when no request of the batch has min_p > 0; with min_p == 0 it
        # would zero nothing anyway.
        probs_sort[probs_sort < probs_sort[:, :1] * min_p] = 0.0
    kept = torch.zeros_like(probs_sort).scatter_(-1, probs_idx, probs_sort).double()
    return kept / kept.sum(dim=-1, keepdim=True)
