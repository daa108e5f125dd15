"""SGLang's scheduler, requests, batches and sampler as Lynx's decode-side code calls them without
hooking them: aborting and releasing a request, the decode batch a verified request rejoins, the
verification's EXTEND forward (a `ScheduleBatch` built field by field, as SGLang's own
`prepare_for_extend` fills it), the sampler's softmax and logprob computation, and the private
helpers of SGLang's queues and batch result processor Lynx calls. What each function calls in
SGLang is fingerprinted per release (`hook_table.CALLED`).

Each imports its SGLang module when called: the callers run in a decode scheduler, where SGLang
has imported them already, and a launcher that never calls them never imports them.

Called by `speculation.controller`, `speculation.verify`, `speculation.penalties`,
`upstream.logprob_layout`, `speculation.grammar`, `speculation.state` and `lynx_sglang.plugin`
(`prefill_kv_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import adapter


def prefill_kv_tokens(queue, req) -> int:
    """How many tokens of KV the prefill sends for `req` (its prompt, or what a rebootstrap
    recomputes): SGLang's decode queue's private `_rebootstrap_prefill_len`."""
    return queue._rebootstrap_prefill_len(req)


def prepare_abort(req, message: str, status_code) -> None:
    """Mark `req` finished as aborted with `message`, as SGLang's disaggregation code does."""
    from sglang.srt.disaggregation.utils import prepare_abort as sglang_prepare_abort

    sglang_prepare_abort(req, message, status_code=status_code)


def release_kv_cache(req, tree_cache, keep_in_cache: bool) -> None:
    """Give `req`'s KV row back to SGLang; with `keep_in_cache` the radix tree first keeps what it
    can key (a finished request), without it nothing is inserted (an aborted one). The flag's
    name differs between releases (`adapter`)."""
    adapter.scheduler().release_kv_cache(req, tree_cache, keep_in_cache)


def decode_batch(scheduler, reqs: list):
    """A decode batch of `reqs` as SGLang builds one for requests rejoining the running batch
    (the scheduler's private `_build_hisparse_decode_batch`)."""
    return scheduler._build_hisparse_decode_batch(reqs)


def count_reasoning_tokens(scheduler, req, tokens: list[int]) -> None:
    """Advance `req`'s reasoning-token counters over `tokens` as SGLang's batch result processing
    does token by token (its private `_maybe_update_reasoning_tokens`)."""
    scheduler.batch_result_processor._maybe_update_reasoning_tokens(req, tokens)


def grammar_rollback_tokens() -> int:
    """How many tokens SGLang's xgrammar matchers can roll back."""
    from sglang.srt.constrained.xgrammar_backend import MAX_ROLLBACK_TOKENS

    return MAX_ROLLBACK_TOKENS


def sampling_backend() -> str:
    """The decode server's `--sampling-backend` (SGLang resolves its default at start-up)."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().kernel.sampling_backend


def sampling_info(batch, vocab_size: int):
    """SGLang's `SamplingBatchInfo` for `batch` (a `ScheduleBatch`, or an object with its
    `reqs` and `device`)."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo.from_schedule_batch(batch, vocab_size)


def sampler_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The softmax SGLang's sampler takes of (temperature-scaled) logits (`adapter`: the op
    differs between releases)."""
    return adapter.scheduler().sampler_softmax(logits)


def returns_original_logprob() -> bool:
    """Whether SGLang returns logprobs of the raw logits (`SGLANG_RETURN_ORIGINAL_LOGPROB`)
    rather than of the sampler's distribution."""
    from sglang.srt.layers.sampler import SGLANG_RETURN_ORIGINAL_LOGPROB

    return bool(SGLANG_RETURN_ORIGINAL_LOGPROB)


def output_logprobs(logprobs: torch.Tensor, top_logprobs_nums: list[int],
                    token_ids_logprobs: list, tokens: torch.Tensor):
    """SGLang's output logprob computation for rows `logprobs` (one per token of `tokens`): the
    result has `token_logprobs`, `top_logprobs_val/idx` and `token_ids_logprobs_val/idx`."""
    from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

    return OutputLogprobProcessor().compute_logprobs(logprobs, top_logprobs_nums,
                                                     token_ids_logprobs, tokens)


@dataclass(frozen=True)
class ExtendRows:
    """What one verification EXTEND forward feeds for each request, in the batch's order: the
    token ids, the KV slots they are written to, and per request its prefix, extend and sequence
    lengths."""

    tokens: list[int]
    locs: list[torch.Tensor]
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]


def extend_forward(scheduler, reqs: list, rows: ExtendRows) -> torch.Tensor:
    """Run one EXTEND forward of `reqs` over `rows` on the scheduler's model (no logprobs, no
    sampling): the logits [sum(extend_lens), vocab] of every fed position, from the full hidden
    states (SGLang's logits processor otherwise keeps only each request's last)."""
    from sglang.srt.layers.logits_processor import LogitsMetadata
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    device = scheduler.req_to_token_pool.device
    batch = ScheduleBatch.init_new(
        reqs=reqs, req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=scheduler.token_to_kv_pool_allocator,
        tree_cache=scheduler.tree_cache, model_config=scheduler.model_config,
        enable_overlap=False, spec_algorithm=scheduler.spec_algorithm,
    )
    batch.forward_mode = ForwardMode.EXTEND
    batch.return_logprob = False
    batch.input_ids = torch.tensor(rows.tokens, dtype=torch.int64, device=device)
    pool_idx = [r.kv.req_pool_idx for r in reqs]
    batch.req_pool_indices = torch.tensor(pool_idx, dtype=torch.int64, device=device)
    batch.req_pool_indices_cpu = torch.tensor(pool_idx, dtype=torch.int64)
    batch.seq_lens = torch.tensor(rows.seq_lens, dtype=torch.int64, device=device)
    batch.seq_lens_cpu = torch.tensor(rows.seq_lens, dtype=torch.int64)
    batch.orig_seq_lens = torch.tensor(rows.seq_lens, dtype=torch.int32, device=device)
    batch.seq_lens_sum = sum(rows.seq_lens)
    batch.out_cache_loc = torch.cat(rows.locs)
    batch.prefix_lens = rows.prefix_lens
    batch.extend_lens = rows.extend_lens
    batch.extend_num_tokens = sum(rows.extend_lens)
    batch.extend_logprob_start_lens = list(rows.extend_lens)
    batch.multimodal_inputs = [None] * len(reqs)
    batch.sampling_info = sampling_info(batch, scheduler.model_config.vocab_size)
    result = scheduler.tp_worker.forward_batch_generation(
        batch, is_verify=True, capture_hidden_mode=CaptureHiddenMode.FULL)
    hidden = result.logits_output.hidden_states
    model = scheduler.tp_worker.model_runner.model
    return model.logits_processor._get_logits(
        hidden, model.lm_head, LogitsMetadata(forward_mode=ForwardMode.DECODE),
        use_logits_buffer=False,
    )[:, : scheduler.model_config.vocab_size]
