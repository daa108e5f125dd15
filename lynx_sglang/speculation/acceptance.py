"""Which speculative tokens the exact model keeps: the acceptance rules of Lynx's verification.

Pure torch, no SGLang: `speculation.verify` calls these with the logits of its verification
forward (exact KV) and, for sampled requests, the logits each speculative token was drawn from
(Anchor KV).

- Greedy: keep the longest prefix whose tokens equal the exact argmax; the first mismatch is
  replaced by the exact argmax. The result is token-identical to exact greedy decoding.
- Sampling (standard speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): draft token
  x_i was drawn from q_i (the sampler's distribution on Anchor KV); keep it with probability
  min(1, p_i(x_i) / q_i(x_i)) where p_i is the exact distribution; at the first rejection draw the
  replacement from normalize(max(0, p_i - q_i)) and stop. Every emitted token is then distributed
  exactly as p given its prefix, whatever q was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Acceptance:
    """`accepted` leading draft tokens are kept; `correction` (if not None) follows them."""

    accepted: int
    correction: int | None


def accept_greedy(exact_logits: torch.Tensor, drafts: list[int]) -> Acceptance:
    """`exact_logits[i]` predicts the token at the position of `drafts[i]`."""
    _check(exact_logits, drafts)
    exact = exact_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == exact[accepted]:
        accepted += 1
    return Acceptance(accepted, None if accepted == len(drafts) else exact[accepted])


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int],
                   generator: torch.Generator | None = None) -> Acceptance:
    """`target_probs[i]` (exact) and `draft_probs[i]` (what `drafts[i]` was sampled from) are
    probability rows over the vocabulary."""
    _check(target_probs, drafts)
    if draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft probabilities {tuple(draft_probs.shape)} do not match the target "
                         f"{tuple(target_probs.shape)}")
    p_all = target_probs.double()
    q_all = draft_probs.double()
    for i, x in enumerate(drafts):
        p, q = p_all[i], q_all[i]
        u = torch.rand((), generator=generator, dtype=torch.float64)
        # q[x] > 0 because x was drawn from q; a zero (rounding) rejects.
        if q[x] > 0 and u * q[x] < p[x]:
            continue
        residual = (p - q).clamp_(min=0)
        total = residual.sum()
        if not total > 0:
            # p == q up to rounding: the rejection then had probability ~0; fall back to p.
            residual, total = p, p.sum()
        y = int(torch.multinomial((residual / total).float(), 1, generator=generator))
        return Acceptance(i, y)
    return Acceptance(len(drafts), None)


def _check(rows: torch.Tensor, drafts: list[int]) -> None:
    if rows.dim() != 2 or rows.shape[0] != len(drafts):
        raise ValueError(f"expected one row per draft token ({len(drafts)}), got a tensor of "
                         f"shape {tuple(rows.shape)}")
    if not torch.isfinite(rows).all():
        raise ValueError("verification logits/probabilities contain NaN or Inf")
