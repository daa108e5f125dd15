"""The `lynx` transfer backend of SGLang PD disaggregation: LynxKVManager, LynxKVSender,
LynxKVReceiver and LynxKVBootstrapServer (SGLang finds them through `get_kv_class`, hooked by
`lynx_sglang.plugin`).

Control plane: SGLang's own. LynxKVManager derives from SGLang's MooncakeKVManager (itself a
CommonKVManager) and keeps its bootstrap registration, the decode's KV-args registration and
per-request TransferInfo messages, status/abort messages and heartbeats unchanged; it replaces
only the data path (Mooncake's one-sided writes) with `lynx_transport` and the codec. The
sender and receiver derive from CommonKVSender / CommonKVReceiver; the bootstrap server is
CommonKVBootstrapServer.

Data path, per request ("room"):
- Decode (`send_metadata`): allocate a range of its registered staging buffer sized exactly for
  the request's Anchor and Residual streams (`kv_streams.stream_nbytes`) and announce it on the
  transport session from the request's prefill rank (deadline `--lynx-transfer-timeout-s`).
- Prefill (last chunk of the request): encode each layer's K and V (`lynx_kernels.encode`), copy
  the Anchor and Residual chunks into its own registered staging range and write them on the two
  streams (strict priority: Anchor bytes go first); SGLang's aux data (first output token, ...)
  travels with the Anchor's completion notice. Then it reports Success to SGLang (its KV may be
  freed: everything it needs is in staging, which is freed when the transport has delivered it).
- Decode applier thread: when the Anchor stream is complete, dequantize it into the request's KV
  pool slots (skipped if the Residual has already landed too) and write the aux data; when the
  Residual stream is complete, overwrite the same slots with the full-precision values.
  Non-speculative (`--no-lynx-speculate`): only then does the room become Success for SGLang (a
  prefill "Success" status arriving earlier is held back), so nothing in SGLang sees
  Anchor-precision KV. Speculative (default): the room becomes Success as soon as the Anchor and
  the aux data are in the pool, SGLang's decode starts, and the room stays here after the
  receiver is cleared until `lynx_sglang.speculation` has consumed its Residual outcome
  (`residual_outcome` / `forget_room`). Anchor-precision KV never reaches a prefix cache: the
  decode-side radix cache is refused at start-up (`sglang_support`).
- Sessions: the prefill connects to the decode's transport endpoint (its address is the
  "session id" SGLang carries in the registration) and announces its identity (SGLang rank
  ip:port) as an empty request `IDENTITY_REQUEST`, so the decode knows which session serves which
  prefill rank.

Failures (transport reasons: peer died, timeout, corruption, out of bounds) fail the room with the
reason through SGLang's `record_failure`/`update_status`, which aborts the request to the client;
the staging range is freed only after the transport request is released.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.common.utils import AuxDataCodec
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs

from lynx_kernels import WireStream
from lynx_transport import Endpoint, FailureReason, Session, Status, Stream, TransportError
from lynx_transport.types import MAX_REQUEST_ID

from . import metrics
from .config import FAULT_RESIDUAL_DELAY_ENV, LynxConfig, LynxConfigError
from .kv_streams import (
    KVPoolView,
    KVStreamError,
    apply_residual,
    encode_layer_into,
    pack_aux,
    parse_anchor,
    stream_nbytes,
    unpack_aux,
    write_anchor,
    write_residual_into,
)
from .residual_state import ResidualOutcome, ResidualState
from .sglang_support import check_sglang_version
from .staging import StagingPool, StagingRange

logger = logging.getLogger(__name__)

# Request id of the identity announcement: above SGLang's bootstrap rooms (< 2**63).
IDENTITY_REQUEST = MAX_REQUEST_ID
_STREAM = {WireStream.ANCHOR: Stream.ANCHOR, WireStream.RESIDUAL: Stream.RESIDUAL}


@dataclass
class _SendItem:
    room: int
    kv_indices: np.ndarray
    is_last: bool
    aux_index: int | None
    wait_event: object | None


@dataclass
class _InFlight:
    """A sent room whose staging range must live until the transport has delivered it."""

    room: int
    session: Session
    staging: StagingRange


@dataclass
class _RxRoom:
    """Decode-side state of one request's transfer."""

    room: int
    prefill: tuple[str, int]
    slots: torch.Tensor
    aux_index: int
    sizes: dict[WireStream, int]
    staging: StagingRange
    created: float = field(default_factory=time.monotonic)
    session: Session | None = None
    anchors: dict | None = None
    # time.monotonic() (system-wide on Linux, so comparable with the transport's timestamps)
    t_anchor_landed: float | None = None
    t_anchor_applied: float | None = None
    t_residual_applied: float | None = None
    residual_applied: bool = False
    prefill_success: bool = False
    # Speculative mode: Success was reported to SGLang when the Anchor was applied.
    reported_at_anchor: bool = False
    failure: str | None = None
    finished: bool = False

    def outcome(self) -> ResidualOutcome:
        if self.failure is not None:
            state = ResidualState.FAILED
        elif self.residual_applied:
            state = ResidualState.APPLIED
        else:
            state = ResidualState.PENDING
        return ResidualOutcome(state, self.failure or "", self.t_anchor_landed,
                               self.t_residual_applied)


class LynxKVManager(MooncakeKVManager):
    # The decode-mode manager of this process (one per scheduler), for the speculation hooks.
    decode_instance: LynxKVManager | None = None
    sender_trace_module = None
    supports_role_switch = False
    supports_deferred_decode_kv_release = False
    # Both ends are Lynx: a prefill-side failure reason (e.g. a codec flag mismatch) travels to
    # the decode in the status message instead of SGLang's generic "prefill might be dead".
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: ServerArgs, is_mla_backend: bool | None = False):
        check_sglang_version()
        if is_mla_backend:
            raise RuntimeError("the lynx transfer backend supports MHA KV pools only, not MLA")
        self.lynx = LynxConfig.from_env() or LynxConfig()
        self.spec = self.lynx.codec_spec()
        self.pool: KVPoolView | None = None
        self._stop = threading.Event()
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._prefill_sessions: dict[tuple[str, int], Session] = {}
        self._rx_rooms: dict[int, _RxRoom] = {}
        # Rooms reported Success at Anchor time, until the speculation controller forgets them.
        self._spec_rooms: dict[int, _RxRoom] = {}
        self._rx_lock = threading.RLock()
        self._rx_wake = threading.Event()
        # Decode: failure reasons this side found itself, by room, until the receiver has read
        # them (`record_failure`).
        self._own_failures: dict[int, str] = {}
        # Fault injection for tests only: hold the Residual back after the Anchor is finished.
        self._fault_residual_delay_s = float(os.environ.get(FAULT_RESIDUAL_DELAY_ENV, "0") or 0)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._send_queue: queue.Queue[_SendItem] = queue.Queue()
            self._pending: dict[int, list[np.ndarray]] = {}
            self._inflight: list[_InFlight] = []
            self._start_thread(self._send_loop, "lynx-send")
        else:
            self._start_thread(self._accept_loop, "lynx-accept")
            self._start_thread(self._apply_loop, "lynx-apply")
            LynxKVManager.decode_instance = self
        logger.info("lynx KV manager (%s) on %s: %s", disaggregation_mode.value,
                    self.endpoint.address, self.lynx)

    def _start_thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._worker_threads.append(t)

    # ---- engine hooks of MooncakeKVManager: the transport replaces Mooncake's engine ---------
    def init_engine(self):
        self.engine = None
        options = {"device": self.lynx.ib_device} if self.lynx.transport == "verbs" else None
        self.endpoint = Endpoint(backend=self.lynx.transport, host=self.local_ip,
                                 backend_options=options, name=f"lynx-{self.rank_port}")

    def register_buffer_to_engine(self):
        self.staging = StagingPool(self.lynx.staging_mib << 20)
        self.staging_region = self.endpoint.register(self.staging.buffer, name="lynx-staging")

    def deregister_buffer_to_engine(self):
        self.endpoint.close()

    def get_session_id(self):
        return self.endpoint.address

    def attach_kv_pool(self, pool) -> None:
        """Called (plugin hook) right after SGLang built this manager, with its KV pool."""
        self.pool = KVPoolView.from_sglang_pool(pool)
        head_dim = self.pool.shape.head_dim
        if self.spec.rotate and head_dim & (head_dim - 1):
            # Refuse at start-up rather than failing every request in the codec later.
            raise LynxConfigError(
                f"--lynx-rotate needs a power-of-two head_dim, this model's is {head_dim}: "
                "pass --no-lynx-rotate on prefill and decode"
            )

    def _require_pool(self) -> KVPoolView:
        if self.pool is None:
            raise RuntimeError("lynx KV manager has no KV pool attached (plugin hook not applied)")
        return self.pool

    # ---- prefill ---------------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk,
                             aux_index=None, state_indices=None, num_kv_tokens=None, *,
                             wait_event=None, indices_event=None, trace_ctx=None):
        if (bootstrap_room not in self.request_status
                or self.check_status(bootstrap_room) == KVPoll.Failed):
            return
        if bootstrap_room not in self.transfer_infos:
            return
        if state_indices and any(s is not None and len(s) for s in state_indices):
            self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=(
                "lynx transfers the attention KV pool only; this model also has state "
                "components (Mamba/SWA/...), which are not supported"))
            return
        if indices_event is not None:
            indices_event.synchronize()
        if isinstance(kv_indices, torch.Tensor):
            kv_indices = kv_indices.cpu().numpy()
        self._send_queue.put(_SendItem(bootstrap_room, np.array(kv_indices, dtype=np.int64),
                                       is_last_chunk, aux_index, wait_event))

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._send_queue.get(timeout=0.05)
            except queue.Empty:
                item = None
            if item is not None:
                self._handle_send_item(item)
            self._reap_inflight()

    def _handle_send_item(self, item: _SendItem) -> None:
        room = item.room
        if room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            self._pending.pop(room, None)
            return
        if item.wait_event is not None:
            item.wait_event.synchronize()
        self._pending.setdefault(room, []).append(item.kv_indices)
        if not item.is_last:
            # The whole request is encoded at its last chunk: quantization groups and protected
            # tokens are defined over the full token range.
            return
        slots = np.concatenate(self._pending.pop(room))
        try:
            self._send_room(room, slots, item.aux_index)
        except Exception as exc:
            logger.exception("lynx: sending room %s failed", room)
            self.conclude_failure(bootstrap_room=room,
                                  failure_reason=f"lynx prefill send failed: {exc}")

    def _session_to(self, address: str) -> Session:
        with self._sessions_lock:
            s = self._sessions.get(address)
            if s is not None and not s.closed:
                return s
            s = self.endpoint.connect(address, timeout=self.lynx.connect_timeout_s)
            identity = {"rank_ip": self.local_ip, "rank_port": self.rank_port}
            s.announce(IDENTITY_REQUEST, {}, meta=json.dumps(identity).encode())
            self._sessions[address] = s
            return s

    def _send_room(self, room: int, prefill_slots: np.ndarray, aux_index: int | None) -> None:
        infos = [i for i in self.transfer_infos.get(room, {}).values() if not i.is_dummy]
        if not infos:
            self.update_status(room, KVPoll.Success)
            return
        pool = self._require_pool()
        shape = pool.shape
        num_tokens = len(prefill_slots)
        sizes = stream_nbytes(self.spec, shape, num_tokens, self.lynx.chunk_tokens)
        aux = pack_aux([
            AuxDataCodec.serialize_data_from_buffer(ptr + item_len * aux_index, item_len)
            for ptr, item_len in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_item_lens,
                                     strict=True)
        ])
        slots = torch.as_tensor(prefill_slots, dtype=torch.int64, device=pool.device)
        for info in infos:
            if len(info.dst_kv_indices) != num_tokens:
                raise KVStreamError(f"decode allocated {len(info.dst_kv_indices)} KV slots for a "
                                    f"request of {num_tokens} tokens")
            session = self._session_to(info.mooncake_session_id)
            ann = session.wait_announcement(room, timeout=self.lynx.connect_timeout_s)
            for ws, n in sizes.items():
                if ann.stream_nbytes(_STREAM[ws]) != n:
                    raise KVStreamError(
                        f"decode announced {ann.stream_nbytes(_STREAM[ws])} B for the "
                        f"{ws.name} stream, this prefill encodes {n} B: the --lynx-* flags or "
                        "the model differ between prefill and decode")
            staging = self.staging.allocate(sizes[WireStream.ANCHOR] + sizes[WireStream.RESIDUAL],
                                            timeout_s=self.lynx.transfer_timeout_s)
            inflight = _InFlight(room, session, staging)
            self._inflight.append(inflight)
            try:
                self._write_streams(session, room, pool, slots, staging, sizes, aux)
            except Exception:
                # A stream never written stays pending for the transport, so the reaper would
                # never free this range: give it back now.
                self._inflight.remove(inflight)
                try:
                    session.release(room)
                except TransportError as exc:
                    logger.debug("lynx: release of room %s: %s", room, exc)
                self.staging.free(staging)
                raise
        self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success,
                               targets=[(i.endpoint, i.dst_port) for i in infos])

    def _write_streams(self, session: Session, room: int, pool: KVPoolView, slots: torch.Tensor,
                       staging: StagingRange, sizes: dict[WireStream, int], aux: bytes) -> None:
        """Encode layer by layer straight into staging: each layer's Anchor chunks are written
        as soon as they are encoded; the Residual chunks are made only after the whole Anchor
        stream (and its aux) is finished, each layer's written as soon as it is placed."""
        layers = pool.shape.num_layers
        # Every layer's share of a stream has the same length (kv_streams.encode_layer_into).
        a_layer = sizes[WireStream.ANCHOR] // layers
        r_layer = sizes[WireStream.RESIDUAL] // layers
        a_base = staging.offset
        r_base = staging.offset + sizes[WireStream.ANCHOR]
        buf = self.staging.buffer
        encoded = []
        for layer in range(layers):
            a_off = a_base + layer * a_layer
            written, layer_encoding = encode_layer_into(
                pool, layer, slots, self.spec, self.lynx.chunk_tokens, room,
                buf[a_off: a_off + a_layer])
            if written != a_layer:
                raise KVStreamError(f"layer {layer}: encoded {written} B of Anchor, "
                                    f"expected {a_layer} B")
            session.write_stream(room, Stream.ANCHOR, self.staging_region, a_off, a_layer,
                                 stream_offset=layer * a_layer)
            encoded.append(layer_encoding)
        session.finish(room, Stream.ANCHOR, aux=aux)
        if self._fault_residual_delay_s:
            logger.warning("lynx: room %s Anchor finished; holding the Residual %.1f s (%s)",
                           room, self._fault_residual_delay_s, FAULT_RESIDUAL_DELAY_ENV)
            time.sleep(self._fault_residual_delay_s)
        if not self.lynx.residual:
            return
        for layer, layer_encoding in enumerate(encoded):
            r_off = r_base + layer * r_layer
            written = write_residual_into(pool, layer_encoding, slots, self.lynx.chunk_tokens,
                                          room, buf[r_off: r_off + r_layer])
            if written != r_layer:
                raise KVStreamError(f"layer {layer}: encoded {written} B of Residual, "
                                    f"expected {r_layer} B")
            session.write_stream(room, Stream.RESIDUAL, self.staging_region, r_off, r_layer,
                                 stream_offset=layer * r_layer)
        session.finish(room, Stream.RESIDUAL)

    def _reap_inflight(self) -> None:
        keep = []
        for f in self._inflight:
            try:
                streams = (Stream.ANCHOR, Stream.RESIDUAL) if self.lynx.residual else (
                    Stream.ANCHOR,)
                done = all(f.session.send_state(f.room, s).done for s in streams)
            except TransportError:
                done = True
            if not done:
                keep.append(f)
                continue
            try:
                f.session.release(f.room)
            except TransportError as exc:
                logger.debug("lynx: release of room %s: %s", f.room, exc)
            self.staging.free(f.staging)
        self._inflight = keep

    # ---- decode ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            s = self.endpoint.accept(timeout=0.5)
            if s is None:
                continue
            try:
                ann = s.wait_announcement(IDENTITY_REQUEST, timeout=self.lynx.connect_timeout_s)
                who = json.loads(ann.meta)
                key = (who["rank_ip"], int(who["rank_port"]))
            except (TransportError, ValueError, KeyError) as exc:
                logger.error("lynx: session from %s without a valid identity: %s",
                             s.peer_address, exc)
                s.close()
                continue
            with self._rx_lock:
                self._prefill_sessions[key] = s
            logger.info("lynx: transport session from prefill rank %s:%d", *key)
            self._rx_wake.set()

    def register_rx_room(self, receiver: LynxKVReceiver, kv_indices, aux_index: int) -> None:
        """Called by the receiver before SGLang sends the request's metadata to the prefill."""
        pool = self._require_pool()
        real = [b for b in receiver.bootstrap_infos if not b.get("is_dummy")]
        if len(real) != 1:
            raise KVStreamError(f"lynx needs exactly one prefill rank per decode rank and "
                                f"request (equal attention TP sizes); got {len(real)}")
        prefill = (real[0]["rank_ip"], int(real[0]["rank_port"]))
        slots = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64), device=pool.device)
        sizes = stream_nbytes(self.spec, pool.shape, len(slots), self.lynx.chunk_tokens)
        # Never block the scheduler thread: a full staging buffer fails the request at once.
        staging = self.staging.allocate(sizes[WireStream.ANCHOR] + sizes[WireStream.RESIDUAL],
                                        timeout_s=0.0)
        rx = _RxRoom(receiver.bootstrap_room, prefill, slots, aux_index, sizes, staging)
        with self._rx_lock:
            self._rx_rooms[rx.room] = rx
            self._try_announce(rx)
        self._rx_wake.set()

    def _try_announce(self, rx: _RxRoom) -> bool:
        s = self._prefill_sessions.get(rx.prefill)
        if s is None or s.closed:
            return False
        a = rx.sizes[WireStream.ANCHOR]
        r = rx.sizes[WireStream.RESIDUAL]
        rid = self.staging_region.id
        s.announce(rx.room, {Stream.ANCHOR: [(rid, rx.staging.offset, a)],
                             Stream.RESIDUAL: [(rid, rx.staging.offset + a, r)]},
                   deadline_s=self.lynx.transfer_timeout_s)
        rx.session = s
        return True

    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            with self._rx_lock:
                rooms = [rx for rx in self._rx_rooms.values() if not rx.finished]
            for rx in rooms:
                with self._rx_lock:
                    if rx.finished or rx.room not in self._rx_rooms:
                        continue
                    try:
                        self._step(rx)
                    except Exception as exc:
                        logger.exception("lynx: applying room %s failed", rx.room)
                        self._fail_room(rx, f"lynx decode failed: {exc}")
            self._rx_wake.wait(0.002 if rooms else 0.1)
            self._rx_wake.clear()

    def _step(self, rx: _RxRoom) -> None:
        if rx.residual_applied:
            return  # waiting for the prefill's Success status (update_status concludes)
        if rx.session is None and not self._try_announce(rx):
            # The prefill opens its session at its first transfer, after that request's prefill
            # forward: the whole transfer deadline applies, not the connect timeout.
            if time.monotonic() - rx.created > self.lynx.transfer_timeout_s:
                self._forget_prefill_rank(rx.prefill)
                self._fail_room(rx, f"no transport session from prefill rank {rx.prefill} "
                                    f"within {self.lynx.transfer_timeout_s:g} s")
            return
        pool = self._require_pool()
        view = self.staging.view(rx.staging)
        a_len = rx.sizes[WireStream.ANCHOR]
        if rx.anchors is None:
            st = self._landed(rx, Stream.ANCHOR)
            if st is None:
                return
            rx.anchors = parse_anchor(view[:a_len], pool, len(rx.slots), self.spec, rx.room)
            rx.t_anchor_landed = st.t_done
            # When the Residual has landed too, go straight to full precision.
            residual_landed = rx.session.recv_state(rx.room, Stream.RESIDUAL).ok
            if not residual_landed:
                write_anchor(rx.anchors, pool, rx.slots)
                rx.t_anchor_applied = time.monotonic()
            for index, data in unpack_aux(st.aux or b""):
                AuxDataCodec.deserialize_data_to_buffer(self.kv_args, index, rx.aux_index, data)
            if pool.device.type == "cuda":
                torch.cuda.current_stream(pool.device).synchronize()
            if not self.lynx.residual:
                # Anchor-only baseline: the Anchor is the final KV.
                self._conclude(rx, residual_landed_at=None)
                return
            if self.lynx.speculate and not residual_landed:
                rx.reported_at_anchor = True
                self._spec_rooms[rx.room] = rx
                MooncakeKVManager.update_status(self, rx.room, KVPoll.Success)
        st = self._landed(rx, Stream.RESIDUAL)
        if st is None:
            return
        r_len = rx.sizes[WireStream.RESIDUAL]
        apply_residual(view[a_len: a_len + r_len], rx.anchors, pool, rx.slots, self.spec, rx.room)
        if pool.device.type == "cuda":
            torch.cuda.current_stream(pool.device).synchronize()
        self._conclude(rx, residual_landed_at=st.t_done)

    def _landed(self, rx: _RxRoom, stream: Stream):
        """The stream's receive state once all its bytes have landed; None while it has not (or
        after failing the room because the stream failed)."""
        st = rx.session.recv_state(rx.room, stream)
        if st.status is Status.FAILED:
            name = "Anchor" if stream is Stream.ANCHOR else "Residual"
            if st.reason is FailureReason.PEER_DIED:
                self._forget_prefill_rank(rx.prefill)
            self._fail_room(rx, f"{name} stream failed: {st.reason.value} {st.detail}")
            return None
        return st if st.ok else None

    def _forget_prefill_rank(self, prefill: tuple[str, int]) -> None:
        """The prefill rank died or never connected: drop SGLang's cached bootstrap info that
        points at it, so the next request asks the bootstrap server again. SGLang drops it only
        after its heartbeat misses the prefill twice (5 s apart by default); a prefill restarted
        faster than that came back on a new rank port while every request still went to the
        dead one (and failed after the prefill's 300 s bootstrap timeout)."""
        with self.connection_lock:
            stale = [key for key, infos in self.connection_pool.items()
                     if any((i.get("rank_ip"), int(i.get("rank_port") or 0)) == prefill
                            for i in infos)]
            for key in stale:
                del self.connection_pool[key]
        if stale:
            logger.info("lynx: prefill rank %s:%s is gone; dropped its cached bootstrap info",
                        *prefill)

    def _conclude(self, rx: _RxRoom, residual_landed_at: float | None) -> None:
        """The room's KV is final in the pool: log it, give back the transfer resources, and
        report Success unless that happened at Anchor time (or waits for the prefill's)."""
        now_mono, now_wall = time.monotonic(), time.time()
        rx.residual_applied = True
        rx.t_residual_applied = now_mono
        rx.anchors = None
        residual_bytes = rx.sizes[WireStream.RESIDUAL] if self.lynx.residual else 0
        # One line per request for benchmarks and timelines (wall-clock seconds).
        wall = lambda t: None if t is None else round(now_wall - (now_mono - t), 6)  # noqa: E731
        logger.info("lynx transfer %s", json.dumps({
            "room": rx.room, "tokens": len(rx.slots),
            "anchor_bytes": rx.sizes[WireStream.ANCHOR], "residual_bytes": residual_bytes,
            "announced": wall(rx.created), "anchor_landed": wall(rx.t_anchor_landed),
            "anchor_applied": wall(rx.t_anchor_applied),
            "residual_landed": wall(residual_landed_at),
            "residual_applied": round(now_wall, 6) if self.lynx.residual else None}))
        metrics.record_transfer(
            rx.sizes[WireStream.ANCHOR], residual_bytes,
            None if rx.t_anchor_applied is None else rx.t_anchor_applied - rx.created,
            None if rx.t_anchor_landed is None or not self.lynx.residual
            else now_mono - rx.t_anchor_landed)
        self._release(rx)
        if rx.reported_at_anchor:
            self._finish(rx)  # the speculation controller takes it from here
        elif rx.prefill_success:
            self._finish(rx)
            MooncakeKVManager.update_status(self, rx.room, KVPoll.Success)

    def _release(self, rx: _RxRoom) -> None:
        """Withdraw the announcement (no byte lands after this) and free the staging range."""
        if rx.session is not None:
            try:
                rx.session.release(rx.room)
            except TransportError as exc:
                logger.debug("lynx: release of room %s: %s", rx.room, exc)
            rx.session = None
        if rx.staging is not None:
            self.staging.free(rx.staging)
            rx.staging = None

    def _finish(self, rx: _RxRoom) -> None:
        rx.finished = True
        self._rx_rooms.pop(rx.room, None)

    def _end(self, rx: _RxRoom) -> None:
        """Give back the transfer resources and stop applying: `_release` then `_finish`."""
        self._release(rx)
        self._finish(rx)

    def _fail_room(self, rx: _RxRoom, reason: str) -> None:
        logger.error("lynx: room %s failed: %s", rx.room, reason)
        self._end(rx)
        if rx.reported_at_anchor:
            # SGLang already has Success and no longer polls: the speculation controller aborts
            # the running request when it reads this outcome.
            rx.failure = reason
            return
        self.record_own_failure(rx.room, reason)
        MooncakeKVManager.update_status(self, rx.room, KVPoll.Failed)

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

    def drop_rx_room(self, room: int, *, keep_speculative: bool = False) -> None:
        """The receiver is done with the room: free what it still holds. With `keep_speculative`
        (a clear after SGLang committed a room reported at Anchor time) the Residual transfer
        goes on for the speculation controller."""
        with self._rx_lock:
            rx = self._rx_rooms.get(room)
            if rx is not None and keep_speculative and rx.reported_at_anchor:
                return
            if rx is not None:
                self._end(rx)
            if not keep_speculative:
                self._spec_rooms.pop(room, None)

    # ---- decode, speculative mode: the interface of lynx_sglang.speculation ------------------
    def residual_outcome(self, room: int) -> ResidualOutcome | None:
        """None if the room was not reported at Anchor time (or is forgotten)."""
        with self._rx_lock:
            rx = self._spec_rooms.get(room)
            return None if rx is None else rx.outcome()

    def forget_room(self, room: int) -> None:
        """The controller consumed the room's APPLIED/FAILED outcome."""
        with self._rx_lock:
            self._spec_rooms.pop(room, None)

    def cancel_residual(self, room: int) -> bool:
        """The request's KV slots are being freed: stop its transfer so nothing is written into
        them any more. Returns True if a pending Residual was cancelled. Holding the lock the
        applier holds while it writes makes this a barrier: no write happens after the return."""
        with self._rx_lock:
            rx = self._spec_rooms.pop(room, None)
            if rx is None or rx.finished:
                return False
            logger.info("lynx: room %s released before its Residual was applied; transfer "
                        "cancelled", room)
            self._end(rx)
            return True

    def update_status(self, bootstrap_room: int, status: KVPoll):
        if self.disaggregation_mode == DisaggregationMode.DECODE and status == KVPoll.Success:
            with self._rx_lock:
                rx = self._rx_rooms.get(bootstrap_room)
                if rx is not None and not rx.finished:
                    # The prefill has sent everything; hold Success until the Residual is in
                    # the KV pool (the applier thread concludes the room), or, speculative, it
                    # was reported when the Anchor was applied.
                    rx.prefill_success = True
                    if not rx.residual_applied or rx.reported_at_anchor:
                        self._rx_wake.set()
                        return
                    self._finish(rx)
                elif bootstrap_room in self._spec_rooms:
                    return
        super().update_status(bootstrap_room, status)


class LynxKVSender(CommonKVSender):
    """Prefill side of one request: SGLang's CommonKVSender, whose `send` queues the request's
    KV indices on LynxKVManager.add_transfer_request (no CUDA host-index fast path)."""


class LynxKVReceiver(CommonKVReceiver):
    """Decode side of one request: reserves and announces the request's staging range before
    SGLang sends its KV indices to the prefill; frees it on clear/abort."""

    def init(self, prefill_dp_rank: int):
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or not hasattr(self, "prefill_info"):
            return
        if self.prefill_info.attn_tp_size != self.kv_mgr.attn_tp_size:
            self._fail(f"lynx needs equal attention TP sizes on prefill "
                       f"({self.prefill_info.attn_tp_size}) and decode "
                       f"({self.kv_mgr.attn_tp_size})")

    def _fail(self, reason: str) -> None:
        self.kv_mgr.record_own_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                      decode_prefix_len=None, destination=None, device_kv_indices=None):
        if self.conclude_state == KVPoll.Failed or getattr(self, "bootstrap_infos", None) is None:
            return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
        if decode_prefix_len:
            self._fail("lynx does not support a decode-side prefix cache")
            return None
        try:
            self.kv_mgr.register_rx_room(self, kv_indices, aux_index)
        except Exception as exc:
            logger.error("lynx: room %s: %s", self.bootstrap_room, exc)
            self._fail(f"lynx decode could not prepare the transfer: {exc}")
            return None
        kwargs = {} if destination is None else {"destination": destination}
        return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len,
                                     device_kv_indices=device_kv_indices, **kwargs)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.drop_rx_room(self.bootstrap_room, keep_speculative=True)

    def abort(self):
        super().abort()
        self.kv_mgr.drop_rx_room(self.bootstrap_room)
        self.kv_mgr.forget_own_failure(self.bootstrap_room)

    def failure_exception(self):
        # SGLang pops the room's failure record in there; the own reason stays authoritative
        # until then (a prefill status arriving meanwhile must not replace it).
        try:
            super().failure_exception()
        finally:
            self.kv_mgr.forget_own_failure(self.bootstrap_room)


class LynxKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap registry, unchanged."""
