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
(`release_kv_cache`), `speculation.hooks` (`disable_topk_shortcut`), `backend.layer_stream`
(`extend_bounds`).
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


@dataclass(frozen=True)
class SchedulerLayout:
    """What the speculation controller reads or calls in SGLang's scheduler."""

    # all_reduce_flags(flags, group, op) -> flags reduced over `group` (same order every rank)
    all_reduce_flags: Callable[[list[int], object, object], list[int]]
    # Req attributes SGLang's reasoning-token accounting (batch_result_processor.
    # _maybe_update_reasoning_tokens) advances token by token; reasoning_tokens also decides how
    # much `--strip-thinking-cache` strips. Speculation saves them at commit and restores them
    # before recounting the verified tokens.
    reasoning_state: tuple[str, ...]
    # Whether the decode's commit gives the prefill's token a token-ids-logprob row.
    first_token_has_ids_logprob_row: bool

    def token_ids_logprob_rows(self, output_tokens: int) -> int:
        """How many entries the requested-token-ids logprob lists hold for a request's first
        `output_tokens` output tokens."""
        if self.first_token_has_ids_logprob_row:
            return output_tokens
        return max(output_tokens - 1, 0)


# The reasoning-token counters every supported release's Req has.
_REASONING_STATE = ("reasoning_tokens", "_is_reasoning_over", "_think_end_match_len")


def _all_reduce_flags(flags: list[int], group, op) -> list[int]:
    """SGLang 0.5.23's `all_reduce_flags`, which 0.5.22 lacks: one small int per entry reduced
    over `group`; empty or single-rank: unchanged."""
    import torch
    import torch.distributed as dist

    if not flags or dist.get_world_size(group) == 1:
        return flags
    tensor = torch.tensor(flags, dtype=torch.int32, device="cpu")
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


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
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver, CommonKVSender
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVReceiver, MooncakeKVSender

    # 0.5.23 moved failure_exception (with send/poll/send_metadata) into the Common classes.
    if "failure_exception" in vars(CommonKVSender):
        found = TransferLayout("common-transfer (the SGLang 0.5.23 layout)", CommonKVSender,
                               CommonKVReceiver)
    else:
        found = TransferLayout("mooncake-transfer (the SGLang 0.5.22 layout)", MooncakeKVSender,
                               MooncakeKVReceiver)
    logger.info("lynx: SGLang's transfer classes: %s", found.layout)
    return found


@functools.cache
def scheduler() -> SchedulerLayout:
    """The installed SGLang's scheduler layout (imports its request and decode modules)."""
    from sglang.srt.disaggregation import utils
    from sglang.srt.managers.schedule_batch import Req

    return SchedulerLayout(
        all_reduce_flags=getattr(utils, "all_reduce_flags", _all_reduce_flags),
        reasoning_state=_REASONING_STATE + (
            # 0.5.23: reasoning the model opens itself is counted from its start tag.
            ("_think_start_match_len",) if hasattr(Req, "update_self_opened_reasoning_tokens")
            else ()),
        first_token_has_ids_logprob_row=_commit_reserves_ids_logprob_row())
