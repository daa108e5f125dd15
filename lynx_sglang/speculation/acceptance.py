"""Which speculative tokens the exact model keeps: the acceptance rules of Lynx's verification.

Pure torch, no SGLang: `speculation.verify` calls these with the logits of its verification
forward (exact KV) and, for sampled requests, the logits each speculative token was drawn from
(Anchor KV).

- Greedy: keep the longest prefix whose tokens equal the exact argmax; the first mismatch is
  replaced by the exact argmax. The result is token-identical to exact greedy decoding.
- The verification may also feed the last draft token, giving one row more than there are drafts:
  when every draft is kept, that row's exact token follows them (a "bonus" token: the decode step
  the verification forward has already done), argmax for greedy, drawn from p for sampling.
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
    """`accepted` leading draft tokens are kept; `next_token` (if not None) is the exact token
    after them: the replacement of the first rejected draft, or, when every draft is kept and the
    verification had the extra row, the bonus token."""

    accepted: int
    next_token: int | None


def accept_greedy(exact_logits: torch.Tensor, drafts: list[int]) -> Acceptance:
    """`exact_logits[i]` predicts the token at the position of `drafts[i]` (and row
    `len(drafts)`, if given, the token after the last draft)."""
    _check(exact_logits, drafts)
    exact = exact_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == exact[accepted]:
        accepted += 1
    return Acceptance(accepted, exact[accepted] if accepted < len(exact) else None)


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: list[int],
                   generator: torch.Generator | None = None) -> Acceptance:
    """`target_probs[i]` (exact) and `draft_probs[i]` (what `drafts[i]` was sampled from) are
    probability rows over the vocabulary; a last target row past the drafts gives the bonus."""
    _check(target_probs, drafts)
    if draft_probs.shape != (len(drafts), target_probs.shape[1]):
        raise ValueError(f"draft probabilities {tuple(draft_probs.shape)} do not match the target "
                         f"{tuple(target_probs.shape)} and {len(drafts)} drafts")
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
    if len(p_all) > len(drafts):
        return Acceptance(len(drafts), int(torch.multinomial(p_all[-1].float(), 1,
                                                             generator=generator)))
    return Acceptance(len(drafts), None)


def _check(rows: torch.Tensor, drafts: list[int]) -> None:
    if rows.dim() != 2 or rows.shape[0] not in (len(drafts), len(drafts) + 1):
        raise ValueError(f"expected one row per draft token ({len(drafts)}), and optionally one "
                         f"for the bonus token, got a tensor of shape {tuple(rows.shape)}")
    # -inf is a masked token (min_new_tokens' stop tokens, a -inf logit bias); NaN and +inf are
    # a broken forward.
    if rows.isnan().any() or rows.isposinf().any():
        raise ValueError("verification logits/probabilities contain NaN or Inf other than -inf")
