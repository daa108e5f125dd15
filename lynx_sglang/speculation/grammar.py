"""Grammar-constrained requests (JSON schema, regex, EBNF) under speculation.

SGLang advances a request's grammar matcher with every decode step's token, speculative ones
included, and masks each step's logits with the tokens the matcher allows next
(`SamplingBatchInfo.update_regex_vocab_mask`, then `apply_logits_bias`). Verification therefore
needs the mask of every speculative position, and afterwards the matcher must stand at the
verified output, not at the rejected drafts:

- `rollback_capable`: the grammar object can undo accepted tokens (SGLang's xgrammar backend,
  its default, keeps the tokens it accepted and a matcher built with room for `rollback_cap`
  tokens); requests with another backend's grammar wait for their Residual.
- `rewind`: the matcher back to the verified prefix (every token accepted since the request's
  `SpecState.grammar_base`, taken when the prebuilt batch accepted its first token). Then
  `penalties.exact_rows` steps it through the drafts again, filling each position's mask as
  SGLang's sampler does, so each exact row is masked as exact decoding would have masked it.
- `resync`: after the decision, the matcher at the verified output (kept drafts and the exact
  next token). A terminated matcher ignores further tokens, as in SGLang's decode.

Called by `speculation.verify.sampler_rows` and `speculation.controller`, on the decode scheduler
thread.
"""

from __future__ import annotations

from ..upstream import scheduler_api


def rollback_capable(grammar) -> bool:
    return (callable(getattr(grammar, "rollback", None))
            and isinstance(getattr(grammar, "accepted_tokens", None), list))


def rollback_cap() -> int:
    """Speculative tokens a grammar request may take: one fewer than the matcher can roll back
    (SGLang builds xgrammar matchers with room for MAX_ROLLBACK_TOKENS), so that a held-back
    finish's token fits too."""
    return scheduler_api.grammar_rollback_tokens() - 1


def rewind(req, grammar_base: int) -> None:
    """Undo every token the request's matcher accepted since it stood at `grammar_base` accepted
    tokens."""
    grammar = req.grammar
    k = len(grammar.accepted_tokens) - grammar_base
    if k < 0:
        raise RuntimeError(f"lynx verify: the grammar of request {req.rid} holds "
                           f"{len(grammar.accepted_tokens)} tokens, fewer than the "
                           f"{grammar_base} it had when speculation began")
    if k:  # rollback(0) would drop every accepted token (SGLang slices accepted_tokens[:-k])
        grammar.rollback(k)


def resync(req, grammar_base: int, verified_len: int) -> None:
    """The matcher at req.output_ids (after `verify.apply_acceptance`): back to the verified
    prefix, then fed the tokens past it."""
    rewind(req, grammar_base)
    for token in req.output_ids[verified_len:]:
        req.grammar.accept_token(token)
