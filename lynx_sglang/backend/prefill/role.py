"""The prefill side of `backend.manager.LynxKVManager`: `PrefillRole`, the one role object a
prefill's manager delegates to (chosen once, in its constructor). It owns the prefill's sender
(`sender.PrefillSender`, thread `lynx-send`), this rank's signed bootstrap rows and their leases
(thread `lynx-lease`, `backend.registration.Registrar`), and the aborts that reach this prefill
before their room (`early_aborts`); it answers the sender's questions about SGLang's side of a room
(`link.PrefillLink`) from the manager's SGLang state.

Built by the manager before SGLang's constructor (SGLang's bootstrap registration and its abort
handling run inside it), started after it (`start`). Every method runs on the thread of its
caller: SGLang's scheduler (`add_transfer_request`, `update_status`), its bootstrap thread
(`register_row`, `watch_receive`), the sender's threads (the link's callbacks).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import replace

from ...errors import KVStreamError
from ...recorder import Recorder
from ...runtime import LynxRuntime
from ...upstream.kv_transfer import ABORT_TAG, AuxDataCodec, KVPoll
from ..aux import pack_aux
from ..identity import Identity
from ..pages import token_slots
from ..rank_key import Claimant
from .early_aborts import EarlyAborts
from .faults import FaultPlan
from .layer_stream import LayerStreamer
from .link import Destination, PrefillLink, destination_of
from .sender import PrefillSender

logger = logging.getLogger(__name__)

# Rooms a prefill remembers as aborted before they reached it (`early_aborts`): a few hundred KiB
# at most, whatever a decode sends.
EARLY_ABORTS_CAP = 4096
EARLY_ABORT_REASON = "the decode aborted this request before it reached this prefill"


class PrefillRole:
    """What a prefill's manager does beyond SGLang's: see the module docstring. `kv` is the
    manager (`LynxKVManager`), whose SGLang state (request statuses, transfer infos, the decodes'
    KV args) and endpoint, staging and pool this role reads."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.registered: list[tuple[str, dict]] = []  # this rank's signed rows: their leases
        self.early_aborts = EarlyAborts(
            float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)),
            EARLY_ABORTS_CAP)
        self.sender: PrefillSender | None = None

    def start(self, recorder: Recorder, start_thread: Callable[[Callable, str], None]) -> None:
        """After SGLang's constructor: the leases of the rows it registered, and the sender."""
        kv = self.kv
        if self.registered:
            start_thread(functools.partial(kv.registrar.keep_leases, self.registered),
                         "lynx-lease")
        me = Identity(kv.local_ip, kv.rank_port, kv.lynx.wire_settings())
        self.sender = PrefillSender(
            kv.lynx, kv.require_pool, kv.staging, kv.staging_region, kv.endpoint,
            Claimant(me, kv.rank_key),
            PrefillLink(self._room_live, self._destinations, self._read_aux, self._report),
            recorder, FaultPlan.from_env())
        start_thread(self.sender.run, "lynx-send")

    def tracked(self) -> dict[str, int]:
        return self.sender.tracked()

    def complete_runtime(self, rt: LynxRuntime) -> LynxRuntime:
        """The runtime with the sender and (where layer streaming is on) its layer streamer."""
        streamer = None
        if self.kv.lynx.layer_stream:
            pool = self.kv.require_pool()
            streamer = LayerStreamer.for_pool(self.sender, pool.shape.num_layers,
                                              pool.device.type)
        return replace(rt, sender=self.sender, layer_stream=streamer)

    # ---- SGLang's bootstrap thread -----------------------------------------------------------
    def register_row(self, url: str, payload: dict) -> dict:
        """This rank's bootstrap row, signed (`backend.registration`), its lease kept from
        `start` on; another row unchanged."""
        kv = self.kv
        if (payload.get("rank_ip"), payload.get("rank_port")) == (kv.local_ip, kv.rank_port):
            payload = kv.registrar.sign(payload)
            self.registered.append((url, payload))
        return payload

    def watch_receive(self, recv: Callable[[], list | None]) -> Callable[[], list | None]:
        """SGLang's receive for one of its worker threads' sockets, each message shown to
        `note_abort` first (only the bootstrap thread receives on a prefill)."""
        def receive_noting_aborts():
            msg = recv()
            if msg is not None and len(msg) >= 2 and msg[0] == ABORT_TAG:
                self.note_abort(msg[1])
            return msg
        return receive_noting_aborts

    def note_abort(self, room_frame: bytes) -> None:
        """A decode's abort of a room: remembered when this prefill does not know the room yet
        (SGLang's handler drops such an abort)."""
        try:
            room = int(room_frame.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return  # SGLang's handler logs the malformed message
        with self.early_aborts.lock:
            if self.kv.request_status.get(room) is None:
                self.early_aborts.note(room)

    # ---- SGLang's scheduler -------------------------------------------------------------------
    def update_status(self, room: int, status: KVPoll,
                      sglang_update: Callable[[int, KVPoll], None]) -> bool:
        """A room that starts bootstrapping after its decode aborted it fails at once; True where
        this role set the status itself (through `sglang_update`, SGLang's own)."""
        if status != KVPoll.Bootstrapping:
            return False
        with self.early_aborts.lock:
            aborted = (self.kv.request_status.get(room) is None
                       and self.early_aborts.take(room))
            sglang_update(room, status)
        if aborted:
            logger.info("lynx: room %s was aborted by its decode before it got here: failed",
                        room)
            self.kv.record_failure(room, EARLY_ABORT_REASON)
            sglang_update(room, KVPoll.Failed)
        return True

    def add_transfer_request(self, room: int, kv_indices, is_last_chunk: bool, aux_index,
                             state_indices, num_kv_tokens, wait_event, indices_event,
                             trace_ctx) -> None:
        """Queue a chunk of a room's KV slots on the sender (SGLang's `add_transfer_request`)."""
        kv = self.kv
        if not self._room_live(room) or room not in kv.transfer_infos:
            return
        if state_indices and any(s is not None and len(s) for s in state_indices):
            kv.conclude_failure(bootstrap_room=room, failure_reason=(
                "lynx transfers the attention KV pool only; this model also has state "
                "components (Mamba/SWA/...), which are not supported"))
            return
        if indices_event is not None:
            indices_event.synchronize()
        try:
            # Pages under --page-size > 1; SGLang's chunks end on page boundaries but the last.
            kv_indices = token_slots(kv_indices, kv.require_pool().page_size, num_kv_tokens)
        except KVStreamError as exc:
            kv.conclude_failure(bootstrap_room=room, failure_reason=str(exc))
            return
        self.sender.submit(room, kv_indices, is_last_chunk, aux_index, wait_event,
                           trace_ctx if is_last_chunk else None)

    # ---- the sender's link to SGLang's side (`link.PrefillLink`) ------------------------------
    def _room_live(self, room: int) -> bool:
        return room in self.kv.request_status and self.kv.check_status(room) != KVPoll.Failed

    def _destinations(self, room: int) -> list[Destination]:
        kv = self.kv
        # Only an unequal MHA pairing reads it; an MLA model's KVArgs have no head counts.
        total_heads = int(getattr(kv.kv_args, "total_kv_head_num", 0)
                          or getattr(kv.kv_args, "kv_head_num", 0) * kv.attn_tp_size)
        return [destination_of(i, kv.decode_kv_args_table.get(i.mooncake_session_id),
                               kv.attn_tp_size, kv.kv_args.engine_rank, total_heads,
                               latent=bool(kv.is_mla_backend))
                for i in list(kv.transfer_infos.get(room, {}).values()) if not i.is_dummy]

    def _read_aux(self, aux_index: int) -> bytes:
        args = self.kv.kv_args
        return pack_aux([
            AuxDataCodec.serialize_data_from_buffer(ptr + item_len * aux_index, item_len)
            for ptr, item_len in zip(args.aux_data_ptrs, args.aux_item_lens, strict=True)
        ])

    def _report(self, room: int, failure: str | None, targets: list[tuple[str, int]]) -> None:
        kv = self.kv
        if failure is not None:
            kv.conclude_failure(bootstrap_room=room, failure_reason=failure)
        elif targets:
            kv.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=targets)
        else:
            kv.report_status(room, None)
