"""The `lynx` transfer backend's KV manager as SGLang sees it: LynxKVManager (SGLang finds it, and
the per-request classes of `backend.conn`, through `get_kv_class`, hooked by `lynx_sglang.plugin`).

Control plane: SGLang's own. LynxKVManager derives from SGLang's MooncakeKVManager (itself a
CommonKVManager) and keeps its bootstrap registration, the decode's KV-args registration and
per-request TransferInfo messages, status/abort messages and heartbeats unchanged; it replaces
only the data path (Mooncake's one-sided writes) with `lynx_transport` and the codec, built by
role in the constructor and forwarded to:

- prefill: `backend.prefill.PrefillSender` (its thread `lynx-send`);
- decode: `backend.decode.DecodeApplier` (threads `lynx-accept`, `lynx-apply`).

SGLang-facing methods (the engine hooks of MooncakeKVManager):
  init_engine / register_buffer_to_engine / deregister_buffer_to_engine / get_session_id
      the transport endpoint and its registered staging memory (`backend.staging`); the session
      id SGLang carries in the decode's registration is the endpoint's address.
  add_transfer_request (prefill)        queue a chunk of a room's KV slots on the sender.
  update_status (decode, status from the prefill)
      a prefill Success is held until the Residual is in the KV pool (the applier decides).
  record_failure                        a reason this side found itself is never overwritten.
  attach_kv_pool                        the plugin hands over SGLang's KV pool after start-up;
                                        the process's `runtime.LynxRuntime` is completed then.
  _register_topology_row (prefill)      SGLang's bootstrap registration, plus this process's
                                        rank key (`backend.rank_key`).

The manager builds the composition its hooks act on (`lynx_runtime`, a `runtime.LynxRuntime`): the
idle waiter at construction, the role's components once it has the pool.

Every status this backend decides reaches SGLang through one method, `report_status`.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import replace

from .. import runtime
from ..config import LynxConfig
from ..errors import KVStreamError, LynxConfigError, SettingsMismatchError
from ..idle import IdleWaiter
from ..metrics import Metrics
from ..names import FAULT_VERIFY_DELAY_ENV
from ..recorder import Recorder
from ..runtime import LynxRuntime
from ..sglang_support import check_anchor_safety
from ..speculation.controller import SpecController
from ..speculation.stream import scheduler_publisher
from ..trace import Trace
from ..upstream.fingerprints import check_release
from ..upstream.hook_check import verify_applied
from ..upstream.kv_transfer import (
    ABORT_TAG,
    AuxDataCodec,
    DisaggregationMode,
    KVArgs,
    KVManagerBase,
    KVPoll,
    ServerArgs,
    disconnect_push_endpoint,
    push_sockets,
    track_worker_thread,
)
from .aux import check_aux_items, pack_aux
from .conn import lookup_prefill_rank
from .decode import DecodeApplier, DecodeLink
from .early_aborts import EarlyAborts
from .faults import FaultPlan
from .heads import source_slices
from .identity import Identity
from .layer_stream import LayerStreamer
from .pages import token_slots
from .peer_sockets import PeerSockets
from .plan import log_staging_fit
from .pool import KINDS, KVPoolView
from .prefill import PrefillSender
from .prefill_link import Destination, PrefillLink, destination_of
from .rank_key import Claimant, RankKey
from .registration import Registrar
from .room import Source
from .staging import StagingPool
from .transport_setup import open_endpoint

logger = logging.getLogger(__name__)

# Rooms a prefill remembers as aborted before they reached it (`backend.early_aborts`): a few
# hundred KiB at most, whatever a decode sends.
EARLY_ABORTS_CAP = 4096
EARLY_ABORT_REASON = "the decode aborted this request before it reached this prefill"


class LynxKVManager(KVManagerBase):
    # With SGLang's --enable-trace each request's sender gets a trace context under this module
    # name (`--trace-modules lynx` selects it); the prefill's stages become its spans.
    sender_trace_module = "lynx"
    supports_role_switch = False
    supports_deferred_decode_kv_release = False
    # Both ends are Lynx: a prefill-side failure reason (e.g. a codec flag mismatch) travels to
    # the decode in the status message instead of SGLang's generic "prefill might be dead".
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: ServerArgs, is_mla_backend: bool | None = False):
        self.lynx = LynxConfig.from_env() or LynxConfig()
        # Where SGLang's modules are imported (a scheduler): which release this is, and whether
        # every hook Lynx registered in this process is in place, before anything serves.
        check_release(self.lynx.allow_unknown_sglang)
        verify_applied()
        # Again here, not only at CLI parsing: a programmatic launch never passes through it.
        check_anchor_safety(server_args)
        recorder = Recorder.for_process(self.lynx.trace_dir, Metrics(
            server_args.served_model_name or server_args.model_path, disaggregation_mode.value,
            getattr(args, "engine_rank", 0) or 0))
        self.pool: KVPoolView | None = None
        self._stop = threading.Event()
        # Decode: failure reasons this side found itself, by room, until the receiver has read
        # them (`record_failure`).
        self._own_failures: dict[int, str] = {}
        # Before SGLang's constructor: the status threads it starts notify the idle wait, and its
        # `register_buffer_to_engine` builds the staging pool, which records its use.
        self.lynx_runtime = LynxRuntime(idle=IdleWaiter(recorder.metrics), recorder=recorder)
        # Before SGLang's constructor: `_register_topology_row`.
        self.rank_key = RankKey()
        self.registrar = Registrar(self.lynx.load_secret(), self.rank_key)
        self._registered: list[tuple[str, dict]] = []  # this rank's rows: their leases
        self.peer_sockets = PeerSockets()  # before SGLang's constructor: `_connect`
        # Before SGLang's constructor too: its bootstrap thread handles aborts from then on.
        self.early_aborts = EarlyAborts(
            float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)),
            EARLY_ABORTS_CAP)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            if self._registered:
                self._start_thread(functools.partial(self.registrar.keep_leases,
                                                     self._registered), "lynx-lease")
            me = Identity(self.local_ip, self.rank_port, self.lynx.wire_settings())
            self.sender = PrefillSender(
                self.lynx, self._require_pool, self.staging, self.staging_region, self.endpoint,
                Claimant(me, self.rank_key),
                PrefillLink(self._room_live, self._destinations, self._read_aux,
                            self._report_prefill),
                recorder, FaultPlan.from_env())
            self._start_thread(self.sender.run, "lynx-send")
        else:
            self.applier = DecodeApplier(
                self.lynx, self._require_pool, self.staging, self.staging_region, self.endpoint,
                DecodeLink(self.report_status, self._write_aux, self._forget_prefill_rank,
                           self.lynx_runtime.idle.notify, lookup_prefill_rank),
                recorder, self.waiting_timeout, tp_ranks=self.attn_tp_size)
            self._start_thread(self.applier.accept_loop, "lynx-accept")
            self._start_thread(self.applier.run, "lynx-apply")
        self.lynx_runtime.idle.report_tracked(self.tracked)
        # The tcp backend's data listener (the verbs backend has none): its events on /metrics.
        listener = getattr(self.endpoint.backend, "listener_counters", None)
        if listener is not None:
            self.lynx_runtime.idle.report_listener(listener)
        logger.info("lynx KV manager (%s) on %s: %s", disaggregation_mode.value,
                    self.endpoint.address, self.lynx)
        started = Trace("server", 0)
        started.mark("started")
        started.facts.update(role=disaggregation_mode.value, address=self.endpoint.address,
                             config=self.lynx.flat())
        recorder.emit(started)

    def tracked(self) -> dict[str, int]:
        """Sizes of this manager's per-request maps, published by `lynx_sglang.idle`."""
        own = self.sender.tracked() if self.disaggregation_mode == DisaggregationMode.PREFILL \
            else self.applier.tracked()
        return {**own, "own_failures": len(self._own_failures)}

    def _start_thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
        t.start()
        track_worker_thread(self, t)

    # ---- engine hooks of MooncakeKVManager: the transport replaces Mooncake's engine ---------
    def init_engine(self):
        self.engine = None
        self.endpoint = open_endpoint(self.lynx, self.local_ip, f"lynx-{self.rank_port}",
                                      getattr(self.kv_args, "ib_device", None),
                                      getattr(self.kv_args, "gpu_id", 0) or 0)

    def register_buffer_to_engine(self):
        # Page-locked for a CUDA pool: the encoded chunks' device-to-host copies then overlap
        # the next layer's encode (`lynx_kernels.chunk_copy`).
        self.staging = StagingPool(self.lynx.staging_mib << 20, self.lynx_runtime.recorder.metrics,
                                   pinned=getattr(self.server_args, "device", None) == "cuda")
        self.staging_region = self.endpoint.register(self.staging.buffer, name="lynx-staging")

    def deregister_buffer_to_engine(self):
        self.endpoint.close()

    def get_session_id(self):
        return self.endpoint.address

    def attach_kv_pool(self, pool) -> None:
        """Called (plugin hook) right after SGLang built this manager, with its KV pool: checks
        it, completes the process's runtime and attaches that to the pool too, where the hooks
        inside the model and the KV cache find it (`runtime.of_kv_pool`)."""
        self.pool = KVPoolView.from_sglang_pool(pool)
        # GPUDirect (registering device memory with the NIC) is not implemented: say so, so an
        # operator comparing with Mooncake knows the encoded bytes leave from host memory.
        logger.info("lynx: staging: %s host memory, %d MiB registered with the %s transport; KV "
                    "pool on %s", "page-locked" if self.staging.pinned else "pageable",
                    self.lynx.staging_mib, self.lynx.transport, self.pool.device)
        self._check_staging_size()
        head_dim = self.pool.shape.head_dim
        if self.lynx.codec.rotate and head_dim & (head_dim - 1):
            # Refuse at start-up rather than failing every request in the codec later.
            raise LynxConfigError(
                f"--lynx-rotate needs a power-of-two head_dim, this model's is {head_dim}: "
                "pass --no-lynx-rotate on prefill and decode"
            )
        self.lynx_runtime = self._complete_runtime()
        runtime.attach(pool, self.lynx_runtime)

    def _complete_runtime(self) -> LynxRuntime:
        """The runtime with this role's components, which need the pool: the prefill's sender and
        (CPU pool) layer streamer, the speculative decode's controller."""
        rt = self.lynx_runtime
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            streamer = None
            if self.lynx.layer_stream:
                streamer = LayerStreamer.for_pool(self.sender, self.pool.shape.num_layers,
                                                  self.pool.device.type)
            return replace(rt, sender=self.sender, layer_stream=streamer)
        if not self.lynx.speculate:
            return rt
        publisher = scheduler_publisher(self.lynx.spec_stream_port, self.bootstrap_host,
                                        getattr(self, "attn_tp_rank", 0),
                                        getattr(self, "system_dp_rank", 0) or 0)
        controller = SpecController(
            self.applier, self.lynx, rt.recorder, publisher,
            fault_verify_delay_s=float(os.environ.get(FAULT_VERIFY_DELAY_ENV, "0") or 0))
        rt.idle.report_tracked(controller.tracked)
        return replace(rt, spec=controller)

    def _check_staging_size(self) -> None:
        """Say at start-up how long a request the staging memory holds whole."""
        rows = int(self.pool.layer(0, KINDS[0]).shape[0])
        log_staging_fit(self.lynx, self.pool.shape, self.staging.nbytes,
                        min(rows, getattr(self.server_args, "context_length", None) or rows))

    # ---- SGLang's control-plane sockets ------------------------------------------------------
    def _register_topology_row(self, url: str, payload: dict) -> None:
        """SGLang's bootstrap registration of a row; this process's own rows with its rank key,
        authenticated and signed (`backend.registration`), their leases renewed from then on."""
        if (payload.get("rank_ip"), payload.get("rank_port")) == (self.local_ip, self.rank_port):
            payload = self.registrar.sign(payload)
            self._registered.append((url, payload))
        super()._register_topology_row(url, payload)

    def _connect(self, endpoint: str, is_ipv6: bool = False):
        """SGLang's cached PUSH socket to `endpoint`, after closing the cached sockets of peers
        that have gone (`backend.peer_sockets`: SGLang replaces a dead peer's socket only when
        that endpoint is dialled again, and a restarted decode comes back on a new port)."""
        self.peer_sockets.before_dial(push_sockets(self), keep=endpoint)
        return super()._connect(endpoint, is_ipv6)

    def _require_pool(self) -> KVPoolView:
        if self.pool is None:
            raise RuntimeError("lynx KV manager has no KV pool attached (plugin hook not applied)")
        return self.pool

    # ---- prefill ---------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk,
                             aux_index=None, state_indices=None, num_kv_tokens=None, *,
                             wait_event=None, indices_event=None, trace_ctx=None):
        if not self._room_live(bootstrap_room) or bootstrap_room not in self.transfer_infos:
            return
        if state_indices and any(s is not None and len(s) for s in state_indices):
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=(
                "lynx transfers the attention KV pool only; this model also has state "
                "components (Mamba/SWA/...), which are not supported"))
            return
        if indices_event is not None:
            indices_event.synchronize()
        try:
            # Pages under --page-size > 1; SGLang's chunks end on page boundaries but the last.
            kv_indices = token_slots(kv_indices, self._require_pool().page_size, num_kv_tokens)
        except KVStreamError as exc:
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=str(exc))
            return
        self.sender.submit(bootstrap_room, kv_indices, is_last_chunk, aux_index, wait_event,
                           trace_ctx if is_last_chunk else None)

    def _room_live(self, room: int) -> bool:
        return room in self.request_status and self.check_status(room) != KVPoll.Failed

    def _destinations(self, room: int) -> list[Destination]:
        # Only an unequal MHA pairing reads it; an MLA model's KVArgs have no head counts.
        total_heads = int(getattr(self.kv_args, "total_kv_head_num", 0)
                          or getattr(self.kv_args, "kv_head_num", 0) * self.attn_tp_size)
        return [destination_of(i, self.decode_kv_args_table.get(i.mooncake_session_id),
                               self.attn_tp_size, self.kv_args.engine_rank, total_heads,
                               latent=bool(self.is_mla_backend))
                for i in list(self.transfer_infos.get(room, {}).values()) if not i.is_dummy]

    def _read_aux(self, aux_index: int) -> bytes:
        return pack_aux([
            AuxDataCodec.serialize_data_from_buffer(ptr + item_len * aux_index, item_len)
            for ptr, item_len in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens,
                                     strict=True)
        ])

    def _report_prefill(self, room: int, failure: str | None,
                        targets: list[tuple[str, int]]) -> None:
        if failure is not None:
            self.conclude_failure(bootstrap_room=room, failure_reason=failure)
        elif targets:
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success, targets=targets)
        else:
            self.report_status(room, None)

    # ---- decode ----------------------------------------------------------------------------
    def report_status(self, room: int, failure: str | None) -> None:
        """The one path by which a status this backend decided reaches SGLang."""
        if failure is not None:
            self.record_own_failure(room, failure)
        super().update_status(room, KVPoll.Failed if failure is not None else KVPoll.Success)
        self.lynx_runtime.idle.notify()

    def _write_aux(self, aux_index: int, items: list[tuple[int, bytes]]) -> None:
        """Write the peer's aux items into the room's aux slot, each checked first: SGLang's own
        writer copies `len(data)` bytes to wherever the index points, unchecked."""
        check_aux_items(items, self.kv_args.aux_item_lens)
        for index, data in items:
            AuxDataCodec.deserialize_data_to_buffer(self.kv_args, index, aux_index, data)

    def _forget_prefill_rank(self, prefill: tuple[str, int]) -> None:
        """The prefill rank died or never connected: drop SGLang's cached bootstrap info that
        points at it, so the next request asks the bootstrap server again, and close the
        receivers' cached PUSH socket to its rank port, as SGLang's own node-failure handler
        does. SGLang drops the info only after its heartbeat misses the prefill twice (5 s apart
        by default); a prefill restarted faster than that came back on a new rank port while
        every request still went to the dead one (and failed after the prefill's 300 s bootstrap
        timeout). The socket, left open, kept dialling the dead port for the life of the decode:
        one zmq socket per prefill restart."""
        with self.connection_lock:
            stale = [key for key, infos in self.connection_pool.items()
                     if any((i.get("rank_ip"), int(i.get("rank_port") or 0)) == prefill
                            for i in infos)]
            for key in stale:
                del self.connection_pool[key]
        disconnect_push_endpoint(*prefill)
        if stale:
            logger.info("lynx: prefill rank %s:%s is gone; dropped its cached bootstrap info",
                        *prefill)

    def register_rx_room(self, receiver, kv_indices, aux_index: int) -> bool:
        """Called by the receiver (`backend.conn.LynxKVReceiver`) before SGLang sends the request's
        metadata to the prefill.
        False: the room is queued for staging (`DecodeApplier.register`)."""
        real = [b for b in receiver.bootstrap_infos if not b.get("is_dummy")]
        ranks = [(b["rank_ip"], int(b["rank_port"])) for b in real]
        if len(ranks) == 1:
            sources = [Source(ranks[0])]
        else:
            # A prefill attention TP size larger than ours: each of those ranks sends all of its
            # KV heads, which fill consecutive slices of ours, in SGLang's order of the ranks.
            slices = source_slices(receiver.prefill_info.attn_tp_size, self.attn_tp_size,
                                   self._require_pool().shape.num_kv_heads)
            if len(slices) != len(ranks):
                raise SettingsMismatchError(
                    f"room {receiver.bootstrap_room} lists {len(ranks)} prefill ranks; at "
                    f"prefill TP {receiver.prefill_info.attn_tp_size} and decode TP "
                    f"{self.attn_tp_size} lynx expects {len(slices)}")
            sources = [Source(rank, heads) for rank, heads in zip(ranks, slices, strict=True)]
        # Pages of the whole prompt under --page-size > 1 (no decode-side prefix); the tail of
        # the last one is where this decode writes its own tokens.
        kv_indices = token_slots(kv_indices, self._require_pool().page_size,
                                 getattr(receiver, "lynx_kv_tokens", None))
        return self.applier.register(receiver.bootstrap_room, sources, kv_indices, aux_index,
                                     getattr(receiver, "lynx_rid", None))

    def record_own_failure(self, room: int, reason: str) -> None:
        """Record why this side failed a room; see `record_failure`."""
        with self.failure_lock:
            self._own_failures[room] = reason
            self.failure_records[room] = reason

    def record_failure(self, bootstrap_room: int, failure_reason: str):
        """SGLang's entry for reasons from elsewhere (the prefill's status message, the
        heartbeat). Once the decode has failed a room itself, the prefill usually fails it too
        *because* the decode withdrew it ("no (live) announcement from the peer"); that later
        message must not replace the cause the decode found."""
        with self.failure_lock:
            own = self._own_failures.get(bootstrap_room)
            self.failure_records[bootstrap_room] = own or failure_reason

    def forget_own_failure(self, room: int) -> None:
        with self.failure_lock:
            self._own_failures.pop(room, None)

    def update_status(self, bootstrap_room: int, status: KVPoll):
        self.lynx_runtime.idle.notify()
        if (self.disaggregation_mode == DisaggregationMode.DECODE and status == KVPoll.Success
                and self.applier.on_prefill_success(bootstrap_room)):
            return
        if self.disaggregation_mode == DisaggregationMode.PREFILL and status == KVPoll.Bootstrapping:
            with self.early_aborts.lock:
                aborted = (self.request_status.get(bootstrap_room) is None
                           and self.early_aborts.take(bootstrap_room))
                super().update_status(bootstrap_room, status)
            if aborted:
                logger.info("lynx: room %s was aborted by its decode before it got here: failed",
                            bootstrap_room)
                self.record_failure(bootstrap_room, EARLY_ABORT_REASON)
                super().update_status(bootstrap_room, KVPoll.Failed)
            return
        super().update_status(bootstrap_room, status)

    def _make_worker_recv(self, socket, *args, **kwargs):
        """SGLang's receive for a worker thread's socket. A prefill's (its bootstrap thread's, the
        only one that receives) first remembers each abort for a room this prefill does not know
        yet (`backend.early_aborts`), which SGLang's handling of the message drops."""
        recv = super()._make_worker_recv(socket, *args, **kwargs)
        if self.disaggregation_mode != DisaggregationMode.PREFILL:
            return recv

        def recv_noting_early_aborts():
            msg = recv()
            if msg is not None and len(msg) >= 2 and msg[0] == ABORT_TAG:
                self._note_early_abort(msg[1])
            return msg
        return recv_noting_early_aborts

    def _note_early_abort(self, room_frame: bytes) -> None:
        try:
            room = int(room_frame.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            return  # SGLang's handler logs the malformed message
        with self.early_aborts.lock:
            if self.request_status.get(room) is None:
                self.early_aborts.note(room)
