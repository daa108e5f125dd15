"""Exact output logprobs for verified tokens.

While a request that asked for logprobs speculates, SGLang's decode steps append the logprobs of
each speculative token as the Anchor-precision forward saw them (the output streamer only sends
the verified prefix's: `hooks.accept_around` cuts output_ids, and SGLang slices the logprob lists
by output_ids). Verification replaces them (`replace_speculative_logprobs`): every entry past the
verified prefix is dropped (a rejected draft's, and under the overlap scheduler the one of a step
that overshot a held finish), and each token the verification keeps or adds gets the logprob, the
top logprobs and the requested token ids' logprobs of the exact row that predicts it, computed as
SGLang's Sampler computes them (`sampler_logprobs`) and gathered by SGLang's own
OutputLogprobProcessor. A client therefore gets the exact distribution's logprobs; the opt-in spec
stream (`speculation.stream`) carries provisional token ids only.

It lives in the SGLang room because it writes SGLang's per-request logprob lists in the layout
SGLang's own decode step appends them (one of the layouts that moved between releases:
`upstream.adapter`).

Called by `speculation.controller.SpecController` after `verify.apply_acceptance`, and on an abort
(`truncate_logprobs`), on the decode scheduler thread.
"""

from __future__ import annotations

import torch

from . import adapter as upstream_adapter
from . import scheduler_api

# SGLang's per-request output logprob lists (ReqLogprob), one entry per output token each where
# the request asked for that kind; the requested token ids' lists lack the prefill's token in
# some releases (`upstream.adapter.SchedulerLayout.token_ids_logprob_rows`).
_TOKEN_IDS_LISTS = ("output_token_ids_logprobs_val", "output_token_ids_logprobs_idx")
_OUTPUT_LISTS = ("output_token_logprobs_val", "output_token_logprobs_idx",
                 "output_top_logprobs_val", "output_top_logprobs_idx", *_TOKEN_IDS_LISTS)


def sampler_logprobs(rows: torch.Tensor, sampling_params, greedy: bool) -> torch.Tensor:
    """The log-probabilities SGLang's Sampler returns for these logits (rows as the sampler sees
    them: penalties and logit bias applied). Greedy: log_softmax of the logits. Sampled: the log
    of the sampler's softmax of logits / temperature, before top-k/top-p/min-p (SGLang filters a
    copy). With SGLANG_RETURN_ORIGINAL_LOGPROB: log_softmax of the logits, no temperature.
    SGLang decides greedy per batch (a greedy request in a batch with sampled ones gets the log
    of the softmax at temperature 1): the same values up to float rounding."""
    logits = rows.float()
    if greedy or scheduler_api.returns_original_logprob():
        return torch.log_softmax(logits, dim=-1)
    temperature = torch.tensor(sampling_params.temperature, dtype=torch.float32,
                               device=logits.device)
    return torch.log(scheduler_api.sampler_softmax(logits / temperature))


def truncate_logprobs(req, keep: int) -> None:
    """Drop the output logprob entries past the first `keep` output tokens."""
    lp = req.logprob
    keep_ids = upstream_adapter.scheduler().token_ids_logprob_rows(keep)
    for name in _OUTPUT_LISTS:
        values = getattr(lp, name, None)
        if values is not None:
            del values[keep_ids if name in _TOKEN_IDS_LISTS else keep:]


def replace_speculative_logprobs(req, verified_len: int, rows: torch.Tensor,
                                 greedy: bool) -> None:
    """`rows[i]` (the verification's sampler rows) predicts output_ids[verified_len + i]: the
    output logprobs of every token past `verified_len` become the exact ones, in the layout
    SGLang's decode step appends them."""
    truncate_logprobs(req, verified_len)
    tokens = req.output_ids[verified_len:]
    if not tokens:
        return
    if rows.shape[0] < len(tokens):
        raise ValueError(f"lynx verify: {rows.shape[0]} exact rows for {len(tokens)} verified "
                         f"tokens of request {req.rid}")
    lp = req.logprob
    logprobs = sampler_logprobs(rows[: len(tokens)], req.sampling_params, greedy)
    n = len(tokens)
    result = scheduler_api.output_logprobs(
        logprobs, [lp.top_logprobs_num] * n, [lp.token_ids_logprob] * n,
        torch.tensor(tokens, dtype=torch.int64, device=logprobs.device))
    lp.output_token_logprobs_val.extend(result.token_logprobs.tolist())
    lp.output_token_logprobs_idx.extend(tokens)
    if lp.top_logprobs_num > 0:
        lp.output_top_logprobs_val.extend(v.tolist() for v in result.top_logprobs_val)
        lp.output_top_logprobs_idx.extend(i.tolist() for i in result.top_logprobs_idx)
    if lp.token_ids_logprob is not None:
        lp.output_token_ids_logprobs_val.extend(v.tolist()
                                                for v in result.token_ids_logprobs_val)
        lp.output_token_ids_logprobs_idx.extend(list(i) for i in result.token_ids_logprobs_idx)
