"""The verification acceptance rules (lynx_sglang.speculation.acceptance): greedy exactness, and that
speculative sampling emits tokens distributed as the exact model's p whatever the draft's q was
(checked by a chi-square test that the naive "keep every draft" rule fails)."""

from __future__ import annotations

import pytest
import torch

from lynx_sglang.speculation.acceptance import Acceptance, accept_greedy, accept_sampled


def _logits_with_argmax(tokens: list[int], vocab: int = 8) -> torch.Tensor:
    rows = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


def test_greedy_keeps_the_agreeing_prefix_and_corrects_the_first_mismatch():
    exact = _logits_with_argmax([3, 1, 4, 1])
    assert accept_greedy(exact, [3, 1, 4, 1]) == Acceptance(4, None)
    assert accept_greedy(exact, [3, 1, 5, 1]) == Acceptance(2, 4)
    assert accept_greedy(exact, [0, 1, 4, 1]) == Acceptance(0, 3)


def test_greedy_bonus_row_gives_the_token_after_the_last_kept_draft():
    exact = _logits_with_argmax([3, 1, 4, 1, 5])  # 4 drafts + the row after the last one
    assert accept_greedy(exact, [3, 1, 4, 1]) == Acceptance(4, 5)
    # A rejection still wins over the bonus row: the correction follows the kept prefix.
    assert accept_greedy(exact, [3, 1, 5, 1]) == Acceptance(2, 4)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="one row per draft"):
        accept_greedy(torch.zeros(4, 8), [1, 2])
    with pytest.raises(ValueError, match="one row per draft"):
        accept_greedy(torch.zeros(1, 8), [1, 2])
    with pytest.raises(ValueError, match="NaN or Inf"):
        accept_greedy(torch.full((1, 8), float("nan")), [1])
    with pytest.raises(ValueError, match="do not match"):
        accept_sampled(torch.full((1, 8), 1 / 8), torch.full((1, 4), 1 / 4), [1])


P = torch.tensor([0.50, 0.25, 0.15, 0.10, 0.00])
Q = torch.tensor([0.10, 0.20, 0.30, 0.20, 0.20])  # far from P, and covers a token P never emits


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    support = probs > 0
    if (counts[~support] > 0).any():
        return float("inf")
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum())


def _emitted_first_tokens(rule, trials: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(P))
    for _ in range(trials):
        draft = int(torch.multinomial(Q, 1, generator=gen))
        counts[rule(draft, gen)] += 1
    return counts


def test_speculative_sampling_emits_the_target_distribution():
    def lynx_rule(draft, gen):
        result = accept_sampled(P[None], Q[None], [draft], gen)
        return draft if result.accepted == 1 else result.next_token

    counts = _emitted_first_tokens(lynx_rule, 6000, seed=1)
    # 3 degrees of freedom over P's support; 16.27 is the 0.1% critical value.
    assert _chi2(counts, P) < 16.27, counts


def test_the_same_check_rejects_keeping_every_draft():
    counts = _emitted_first_tokens(lambda draft, gen: draft, 6000, seed=1)
    assert _chi2(counts, P) > 16.27


def test_sampling_stops_at_the_first_rejection():
    # Position 0: q puts all mass on a token p never emits -> always rejected there.
    p = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    assert accept_sampled(p, q, [0, 2]) == Acceptance(0, 1)
    # Identical distributions accept everything.
    assert accept_sampled(q[1:].repeat(3, 1), q[1:].repeat(3, 1), [0, 1, 2]) == Acceptance(3, None)


def test_sampled_bonus_token_follows_the_exact_distribution():
    """With every draft kept, the extra target row's token is drawn from p (here the drafts are
    always kept: p == q on their rows), so it must be distributed as P."""
    uniform = torch.full((1, len(P)), 1 / len(P))
    target = torch.cat([uniform, P[None]])
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(len(P))
    for _ in range(6000):
        draft = int(torch.multinomial(uniform[0], 1, generator=gen))
        result = accept_sampled(target, uniform, [draft], gen)
        assert result.accepted == 1
        counts[result.next_token] += 1
    assert _chi2(counts, P) < 16.27, counts
