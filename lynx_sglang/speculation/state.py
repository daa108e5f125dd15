"""What speculation knows about one request (`SpecState`, riding on SGLang's Req as `lynx_spec`),
its running totals (`SpecCounters`), the result of one verification (`VerifyResult`), and which
requests may speculate at all (`not_speculable_reason`).

Plain data and pure functions of a Req's sampling parameters: used by `speculation.controller`
and `speculation.verify`, testable without a server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..upstream import scheduler_api
from ..upstream.sampling_filter import FILTERING_BACKEND, has_filter
from .grammar import rollback_capable


@dataclass
class SpecState:
    """Speculation bookkeeping of one request (attribute `lynx_spec` of SGLang's Req)."""

    room: int
    t_committed: float = field(default_factory=time.monotonic)
    # Tokens of output_ids known exact: the first token comes from the prefill's exact forward.
    verified_len: int = 1
    # Tokens of output_ids already on the spec stream (--lynx-spec-stream-port).
    published_len: int = 1
    # Why this request does not speculate at all (None: it does).
    no_spec_reason: str | None = None
    finish_pending: bool = False
    parked_reason: str | None = None
    t_parked: float | None = None
    # Sampled requests: the logits each speculative token was drawn from (one row per token, in
    # order), captured before SGLang's sampler (`sample_before`).
    sampled: bool = False
    # Penalties, logit bias, min_new_tokens (`speculation.penalties`) or a grammar's mask
    # (`speculation.grammar`): draft rows are recorded as the sampler transformed them, and
    # verification transforms the exact rows.
    logit_transforms: bool = False
    draft_logits: list = field(default_factory=list)
    # The decode runs SGLang's overlap schedule: penalties are fed one step late
    # (`penalties.penalty_feed`).
    overlap: bool = False
    # Grammar-constrained requests (`speculation.grammar`): how many tokens the grammar had
    # accepted when speculation began (set by `SpecController.on_prebuilt`), None without one.
    grammar_base: int | None = None
    # SGLang's reasoning-token counters of the request at commit (the release adapter's
    # `reasoning_state`, `upstream.adapter`): speculative tokens advance them, so verification
    # recounts them over the verified tokens.
    reasoning: tuple = ()


@dataclass
class SpecCounters:
    """Totals since start-up, logged with every verification (`lynx spec` line)."""

    verifications: int = 0
    verify_forwards: int = 0
    # Model forward passes run while verifying (SGLang's ModelRunner.forward_pass_id): one per
    # verification batch, whatever the number of speculative tokens.
    verify_model_passes: int = 0
    speculated_tokens: int = 0
    accepted_tokens: int = 0
    rolled_back_tokens: int = 0


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one request's speculative tokens."""

    speculated: int
    accepted: int
    corrected_token: int | None
    # The exact token after all `speculated` kept drafts, from the verification's extra row.
    bonus_token: int | None = None


def is_greedy(req) -> bool:
    sp = req.sampling_params
    return sp.temperature == 0 or sp.top_k == 1


def not_speculable_reason(req) -> str | None:
    """Why a request must wait for its Residual instead of decoding on the Anchor (None if it
    may speculate). Verification reproduces greedy decoding and temperature sampling exactly,
    top-k/top-p/min-p included where SGLang filters with its torch sampler
    (`upstream.sampling_filter`), and penalties, logit bias and min_new_tokens
    (`speculation.penalties`), returns the exact logprobs (`upstream.logprob_layout`) and rolls a
    grammar's matcher back (`speculation.grammar`); custom logit processors would need their
    processor state rolled back."""
    sp = req.sampling_params
    if (not is_greedy(req) and has_filter(sp.top_k, sp.top_p, sp.min_p)
            and _sampling_backend() != FILTERING_BACKEND):
        return "sampled with top-k/top-p/min-p"
    if req.grammar is not None and not rollback_capable(req.grammar):
        return "grammar-constrained (a grammar backend without rollback; xgrammar has it)"
    if req.return_hidden_states:
        return "returns hidden states"
    if req.custom_logit_processor or any(
            not key.startswith(SGLANG_PRIVATE_PARAM) for key in getattr(sp, "custom_params", None)
            or {}):
        return "a custom logit processor or custom parameters"
    return None


# SGLang puts its own keys into custom_params (0.5.23: the reasoning end token ids its OpenAI chat
# endpoint picks for reasoning models, whether the grammar covers the reasoning). Without a custom
# logit processor they only steer the reasoning-token count, which verification recounts, and the
# reasoning grammar wrapper, which keeps no rollback record and so waits (`grammar`): such a
# request may speculate, or every reasoning model's chat request would wait.
SGLANG_PRIVATE_PARAM = "__sglang_"


def _sampling_backend() -> str:
    """The decode server's `--sampling-backend` (SGLang resolves its default at startup)."""
    return scheduler_api.sampling_backend()
