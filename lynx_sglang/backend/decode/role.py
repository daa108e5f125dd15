"""The decode side of `backend.manager.LynxKVManager`: `DecodeRole`, the one role object a
decode's manager delegates to (chosen once, in its constructor). It owns the decode's applier
(`applier.DecodeApplier`, threads `lynx-accept` and `lynx-apply`) and, where speculation is on,
builds the speculation controller once the KV pool is attached; it answers the applier's questions
about SGLang's side (`applier.DecodeLink`: writing a room's aux data, forgetting a dead prefill
rank) from the manager's SGLang state.

Built by the manager before SGLang's constructor, started after it (`start`). Every method runs
on the thread of its caller: SGLang's scheduler (`register_rx_room`, `update_status`), the
applier's threads (the link's callbacks).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace

from ...errors import SettingsMismatchError
from ...names import FAULT_VERIFY_DELAY_ENV
from ...recorder import Recorder
from ...runtime import LynxRuntime
from ...speculation.controller import SpecController
from ...speculation.stream import scheduler_publisher
from ...upstream.kv_transfer import AuxDataCodec, KVPoll, disconnect_push_endpoint
from ..aux import check_aux_items
from ..heads import source_slices
from ..pages import token_slots
from .applier import DecodeApplier, DecodeLink
from .room import Source

logger = logging.getLogger(__name__)


class DecodeRole:
    """What a decode's manager does beyond SGLang's: see the module docstring. `kv` is the
    manager (`LynxKVManager`), whose SGLang state (its KV args, cached bootstrap infos) and
    endpoint, staging and pool this role reads."""

    def __init__(self, kv, lookup_prefill_rank: Callable) -> None:
        self.kv = kv
        self._lookup_prefill_rank = lookup_prefill_rank
        self.applier: DecodeApplier | None = None

    def start(self, recorder: Recorder, start_thread: Callable[[Callable, str], None]) -> None:
        """After SGLang's constructor: the applier and its threads."""
        kv = self.kv
        self.applier = DecodeApplier(
            kv.lynx, kv.require_pool, kv.staging, kv.staging_region, kv.endpoint,
            DecodeLink(kv.report_status, self._write_aux, self.forget_prefill_rank,
                       kv.lynx_runtime.idle.notify, self._lookup_prefill_rank),
            recorder, kv.waiting_timeout, tp_ranks=kv.attn_tp_size)
        start_thread(self.applier.accept_loop, "lynx-accept")
        start_thread(self.applier.run, "lynx-apply")

    def tracked(self) -> dict[str, int]:
        return self.applier.tracked()

    def complete_runtime(self, rt: LynxRuntime) -> LynxRuntime:
        """The runtime with the speculation controller, where speculation is on."""
        kv = self.kv
        if not kv.lynx.speculate:
            return rt
        publisher = scheduler_publisher(kv.lynx.spec_stream_port, kv.bootstrap_host,
                                        getattr(kv, "attn_tp_rank", 0),
                                        getattr(kv, "system_dp_rank", 0) or 0)
        controller = SpecController(
            self.applier, kv.lynx, rt.recorder, publisher,
            fault_verify_delay_s=float(os.environ.get(FAULT_VERIFY_DELAY_ENV, "0") or 0))
        rt.idle.report_tracked(controller.tracked)
        return replace(rt, spec=controller)

    # ---- SGLang's scheduler -------------------------------------------------------------------
    def update_status(self, room: int, status: KVPoll,
                      sglang_update: Callable[[int, KVPoll], None]) -> bool:
        """A prefill's Success is held until the Residual is in the KV pool (the applier reports
        it then through the manager's `report_status`); True where it is held."""
        return status == KVPoll.Success and self.applier.on_prefill_success(room)

    # ---- SGLang's bootstrap thread -----------------------------------------------------------
    def register_row(self, url: str, payload: dict) -> dict:
        """A decode registers no rank of its own with a rank key: its rows go as SGLang makes
        them."""
        return payload

    def watch_receive(self, recv: Callable[[], list | None]) -> Callable[[], list | None]:
        """SGLang's receive unchanged: only a prefill keeps aborts that arrive before their
        room."""
        return recv

    def register_rx_room(self, receiver, kv_indices, aux_index: int) -> bool:
        """See `LynxKVManager.register_rx_room`."""
        kv = self.kv
        real = [b for b in receiver.bootstrap_infos if not b.get("is_dummy")]
        ranks = [(b["rank_ip"], int(b["rank_port"])) for b in real]
        if len(ranks) == 1:
            sources = [Source(ranks[0])]
        else:
            # A prefill attention TP size larger than ours: each of those ranks sends all of its
            # KV heads, which fill consecutive slices of ours, in SGLang's order of the ranks.
            slices = source_slices(receiver.prefill_info.attn_tp_size, kv.attn_tp_size,
                                   kv.require_pool().shape.num_kv_heads)
            if len(slices) != len(ranks):
                raise SettingsMismatchError(
                    f"room {receiver.bootstrap_room} lists {len(ranks)} prefill ranks; at "
                    f"prefill TP {receiver.prefill_info.attn_tp_size} and decode TP "
                    f"{kv.attn_tp_size} lynx expects {len(slices)}")
            sources = [Source(rank, heads) for rank, heads in zip(ranks, slices, strict=True)]
        # Pages of the whole prompt under --page-size > 1 (no decode-side prefix); the tail of
        # the last one is where this decode writes its own tokens.
        kv_indices = token_slots(kv_indices, kv.require_pool().page_size,
                                 getattr(receiver, "lynx_kv_tokens", None))
        return self.applier.register(receiver.bootstrap_room, sources, kv_indices, aux_index,
                                     getattr(receiver, "lynx_rid", None))

    # ---- the applier's link to SGLang's side (`applier.DecodeLink`) ---------------------------
    def _write_aux(self, aux_index: int, items: list[tuple[int, bytes]]) -> None:
        """Write the peer's aux items into the room's aux slot, each checked first: SGLang's own
        writer copies `len(data)` bytes to wherever the index points, unchecked."""
        check_aux_items(items, self.kv.kv_args.aux_item_lens)
        for index, data in items:
            AuxDataCodec.deserialize_data_to_buffer(self.kv.kv_args, index, aux_index, data)

    def forget_prefill_rank(self, prefill: tuple[str, int]) -> None:
        """The prefill rank died or never connected: drop SGLang's cached bootstrap info that
        points at it, so the next request asks the bootstrap server again, and close the
        receivers' cached PUSH socket to its rank port, as SGLang's own node-failure handler
        does. SGLang drops the info only after its heartbeat misses the prefill twice (5 s apart
        by default); a prefill restarted faster than that came back on a new rank port while
        every request still went to the dead one (and failed after the prefill's 300 s bootstrap
        timeout). The socket, left open, kept dialling the dead port for the life of the decode:
        one zmq socket per prefill restart."""
        kv = self.kv
        with kv.connection_lock:
            stale = [key for key, infos in kv.connection_pool.items()
                     if any((i.get("rank_ip"), int(i.get("rank_port") or 0)) == prefill
                            for i in infos)]
            for key in stale:
                del kv.connection_pool[key]
        disconnect_push_endpoint(*prefill)
        if stale:
            logger.info("lynx: prefill rank %s:%s is gone; dropped its cached bootstrap info",
                        *prefill)
