"""The SGLang operations whose place or shape differs between the releases Lynx supports, one
implementation per release layout, chosen once per process by what the installed SGLang has
(feature detection; its version string is never compared).

What differs (read from the 0.5.21, 0.5.22 and 0.5.23 wheels):

- where a transfer backend's per-request classes get their machinery: from 0.5.23 SGLang's
  `CommonKVSender`/`CommonKVReceiver` carry `send`, `poll`, `failure_exception` and
  `send_metadata` (building the wire messages through the manager); up to 0.5.22 those are
  Mooncake's own (`MooncakeKVSender`/`MooncakeKVReceiver`) and the Common ones are abstract. Lynx
  keeps Mooncake's control plane, so its classes derive from whichever class has it;
- the first frame of a decode's abort notification: `ABORT_TAG` from 0.5.22; 0.5.21's prefill
  compares the same bytes inline (it has no constant);
- `all_reduce_flags` (a MIN/MAX all-reduce of small ints over a CPU group) exists in
  `sglang.srt.disaggregation.utils` from 0.5.23 only;
- the `Req` attributes SGLang's reasoning-token accounting advances token by token: 0.5.23 also
  counts reasoning a model opens itself (`Req.update_self_opened_reasoning_tokens`, with its
  `_think_start_match_len`), which 0.5.21's and 0.5.22's `Req` have neither of;
- from 0.5.23 `DecodeTransferQueue._commit_transfer_to_req` reserves an (empty) row of the
  requested token ids' logprobs for the token the prefill sampled, so those two lists have one
  entry per output token; up to 0.5.22 they lack that first row;
- `release_kv_cache`'s flag for keeping the request's KV in the prefix cache: keyword-only
  `checkpoint` from 0.5.22, `is_insert` (default True) in 0.5.21;
- where a `Req` keeps this round's extend: `prefix_len` and `extend_end` from 0.5.22; 0.5.21 has
  the prefix's slots (`prefix_indices`, a tensor) and `extend_range` (start, end);
- the torch sampler's `torch.topk` shortcut for batches whose requests all set top_k
  (`SamplingBatchInfo.max_top_k`) exists from 0.5.22; 0.5.21 always sorts the whole row;
- the softmax the sampler takes of temperature-scaled logits: SGLang's kernel op
  (`sglang.kernels.ops.sampling.softmax`) from 0.5.22, `torch.softmax` in 0.5.21;
- `--disaggregation-decode-host-receive-threshold`: 1 (the default) disables decode host
  receive from 0.5.22; in 0.5.21 0 (its default) does.

Everything else Lynx touches is the same in all of them or reached only through a signature all
accept (e.g. the layer-written hook on `set_mla_kv_buffer`, whose `loc` argument 0.5.21 names
differently; `MooncakeKVManager.add_transfer_request`'s `wait_event`, which 0.5.21 never
passes): `upstream.fingerprints` tells the releases apart for the start-up check, this module
only says how to act on each.

The operations come in three groups, each detected once per process on first use: `transfer()`
(the classes' bases, the abort tag) in every process that loads the backend's classes, the
launcher included; `launch()` (option semantics) where a launcher checks its options, which has
imported SGLang's server arguments; `scheduler()` (the rest) in a scheduler, which has imported
the request and decode modules it reads (a launcher never imports them: seconds on a small CPU).

Who calls it: `upstream.kv_transfer` (`transfer()`: the classes' bases and the abort tag, at
import); `sglang_support` (`launch()`); `speculation.controller` (`scheduler()`:
`all_reduce_flags`, `reasoning_state` at commit), `speculation.verify` (`reasoning_state` at
verification), `upstream.logprob_layout` (`token_ids_logprob_rows`), `upstream.scheduler_api`
(`release_kv_cache`, `sampler_softmax`), `speculation.hooks` (`disable_topk_shortcut`),
`backend.prefill.layer_stream` (`extend_bounds`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferLayout:
    """Where SGLang keeps a transfer backend's per-request machinery."""

    layout: str  # which SGLang layout this is, for the log (not a version string)
    kv_sender_base: type  # the SGLang class LynxKVSender derives from
    kv_receiver_base: type  # the SGLang class LynxKVReceiver derives from
    abort_tag: bytes  # the first frame of a decode's abort notification to a prefill


@dataclass(frozen=True)
class LaunchLayout:
    """What SGLang's server options mean where Lynx checks them in a launcher."""

    # the --disaggregation-decode-host-receive-threshold that disables decode host receive
    host_receive_off: float


@dataclass(frozen=True)
class SchedulerLayout:
    """What Lynx reads or calls in SGLang's scheduler: the speculation controller, the layer
    streamer of a prefill."""

    # all_reduce_flags(flags, group, op) -> flags reduced over `group` (same order every rank)
    all_reduce_flags: Callable[[list[int], object, object], list[int]]
    # Req attributes SGLang's reasoning-token accounting (batch_result_processor.
    # _maybe_update_reasoning_tokens) advances token by token; reasoning_tokens also decides how
    # much `--strip-thinking-cache` strips. Speculation saves them at commit and restores them
    # before recounting the verified tokens.
    reasoning_state: tuple[str, ...]
    # Whether the decode's commit gives the prefill's token a token-ids-logprob row.
    first_token_has_ids_logprob_row: bool
    # release_kv_cache(req, tree_cache, keep_in_cache): SGLang's, its flag passed by its name
    release_kv_cache: Callable[[object, object, bool], None]
    # extend_bounds(req) -> (prefix length, end of this round's extend or None)
    extend_bounds: Callable[[object], tuple[int, int | None]]
    # sampler_softmax(logits) -> the probabilities SGLang's torch sampler draws from
    sampler_softmax: Callable
    # Whether SamplingBatchInfo has the sampler's topk shortcut (`max_top_k`).
    has_topk_shortcut: bool

    def disable_topk_shortcut(self, sampling_info) -> None:
        """Have the torch sampler sort whole rows for this batch, cutting ties at top_k as
        `upstream.sampling_filter` does (a release without the shortcut always does)."""
        if self.has_topk_shortcut:
            sampling_info.max_top_k = None

    def token_ids_logprob_rows(self, output_tokens: int) -> int:
        """How many entries the requested-token-ids logprob lists hold for a request's first
        `output_tokens` output tokens."""
        if self.first_token_has_ids_logprob_row:
            return output_tokens
        return max(output_tokens - 1, 0)


# The reasoning-token counters every supported release's Req has.
_REASONING_STATE = ("reasoning_tokens", "_is_reasoning_over", "_think_end_match_len")


def _all_reduce_flags(flags: list[int], group, op) -> list[int]:
    """SGLang 0.5.23's `all_reduce_flags`, which 0.5.21 and 0.5.22 lack: one small int per entry
    reduced over `group`; empty or single-rank: unchanged."""
    import torch
    import torch.distributed as dist

    if not flags or dist.get_world_size(group) == 1:
        return flags
    tensor = torch.tensor(flags, dtype=torch.int32, device="cpu")
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def _extend_bounds(req) -> tuple[int, int | None]:
    return req.prefix_len, req.extend_end


def _extend_range_bounds(req) -> tuple[int, int | None]:
    """0.5.21: the prefix as `prepare_for_extend` counts it (its slots), the extend's range."""
    end = None if req.extend_range is None else req.extend_range.end
    return len(req.prefix_indices), end


def _release_kv_cache(flag: str) -> Callable[[object, object, bool], None]:
    """SGLang's `release_kv_cache` with its keep-in-cache flag passed by the name `flag`."""

    def release_kv_cache(req, tree_cache, keep_in_cache: bool) -> None:
        # Looked up at each call: the module's attribute is the function under Lynx's hooks.
        from sglang.srt.mem_cache import common

        common.release_kv_cache(req, tree_cache, **{flag: keep_in_cache})

    return release_kv_cache


def _torch_softmax(logits):
    """0.5.21's sampler: `torch.softmax` over the vocabulary."""
    import torch

    return torch.softmax(logits, dim=-1)


def _commit_reserves_ids_logprob_row() -> bool:
    """0.5.23's `_commit_transfer_to_req` appends the empty row itself; there is no flag or
    parameter to ask, so its source is read. It cannot misread an unknown release silently: the
    function is fingerprinted (a hook target), so another body is refused at start-up."""
    import inspect

    from sglang.srt.disaggregation.decode import DecodeTransferQueue

    fn = inspect.unwrap(DecodeTransferQueue._commit_transfer_to_req)  # under Lynx's hooks
    return "output_token_ids_logprobs_val.append(" in inspect.getsource(fn)


@functools.cache
def transfer() -> TransferLayout:
    """The installed SGLang's transfer layout (imports its disaggregation conn modules)."""
    from sglang.srt.disaggregation.common import conn as common
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver, MooncakeKVSender

    # 0.5.21's prefill matches these bytes inline; the decode's abort sends the same frames.
    abort_tag = getattr(common, "ABORT_TAG", b"ABORT")
    # 0.5.23 moved failure_exception (with send/poll/send_metadata) into the Common classes.
    if "failure_exception" in vars(common.CommonKVSender):
        found = TransferLayout("common-transfer (the SGLang 0.5.23 layout)",
                               common.CommonKVSender, common.CommonKVReceiver, abort_tag)
    else:
        found = TransferLayout("mooncake-transfer (the SGLang 0.5.21/0.5.22 layout)",
                               MooncakeKVSender, MooncakeKVReceiver, abort_tag)
    logger.info("lynx: SGLang's transfer classes: %s", found.layout)
    return found


@functools.cache
def launch() -> LaunchLayout:
    """What the installed SGLang's server options mean (imports its server arguments)."""
    import inspect

    from sglang.srt.server_args import ServerArgs

    # The default is the value that disables host receive in every release (1.0 from 0.5.22,
    # 0.0 in 0.5.21, where any value above 0 enables it).
    threshold = inspect.signature(ServerArgs).parameters[
        "disaggregation_decode_host_receive_threshold"]
    return LaunchLayout(host_receive_off=float(threshold.default))


@functools.cache
def scheduler() -> SchedulerLayout:
    """The installed SGLang's scheduler layout (imports its request, decode, cache and sampling
    modules)."""
    import dataclasses
    import inspect

    from sglang.kernels.ops import sampling as sampling_ops
    from sglang.srt.disaggregation import utils
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    release_params = inspect.signature(release_kv_cache).parameters  # through hook wrappers

    return SchedulerLayout(
        all_reduce_flags=getattr(utils, "all_reduce_flags", _all_reduce_flags),
        reasoning_state=_REASONING_STATE + (
            # 0.5.23: reasoning the model opens itself is counted from its start tag.
            ("_think_start_match_len",) if hasattr(Req, "update_self_opened_reasoning_tokens")
            else ()),
        first_token_has_ids_logprob_row=_commit_reserves_ids_logprob_row(),
        # 0.5.21's flag is `is_insert`.
        release_kv_cache=_release_kv_cache(
            "checkpoint" if "checkpoint" in release_params else "is_insert"),
        # 0.5.21 sets a request's extend as a range (`Req.set_extend_range`).
        extend_bounds=(_extend_range_bounds if hasattr(Req, "set_extend_range")
                       else _extend_bounds),
        sampler_softmax=getattr(sampling_ops, "softmax", _torch_softmax),
        has_topk_shortcut="max_top_k" in {f.name for f in dataclasses.fields(SamplingBatchInfo)})
