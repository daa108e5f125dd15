"""The prefill side of the `lynx` backend: `PrefillSender` encodes each finished request's KV into
its staging range and writes the two streams to the decode that announced it.

Per request ("room"), on the sender thread:
1. SGLang queues the request's KV slots chunk by chunk (`submit`); the whole request is encoded at
   its last chunk (quantization groups and protected tokens span the full token range).
2. `_send`: the room's plan (`backend.plan.StreamPlan`) must match the decode's announcement
   (sizes of both streams; a mismatch means the two servers' `--lynx-*` flags or models differ);
   a staging range is allocated; each layer's Anchor is encoded straight into staging and written
   at once; after the whole Anchor (finished with SGLang's aux data: first token etc.), each
   layer's Residual. Then Success is reported: SGLang may free the room's KV slots, since staging
   holds everything still to be sent.
3. The staging range lives until the transport has delivered both streams (`_reap`).

Given by `backend.manager.LynxKVManager`: the pool view, the staging pool and its region, the
transport endpoint, the codec and serving config, and `PrefillLink` (what the sender asks SGLang's
side: is the room still live, where does it go, its aux bytes; and the one status report).
Buffer ownership: the staging range of a room belongs to the sender from `allocate` until `_reap`
(or the failure path) frees it, after `Session.release` guarantees no byte is read again.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lynx_kernels import CodecSpec, WireStream
from lynx_transport import Endpoint, Region, Session, Stream, TransportError
from lynx_transport.types import MAX_REQUEST_ID

from ..config import LynxConfig
from ..errors import KVStreamError
from .plan import StreamPlan
from .pool import KVPoolView
from .staging import StagingPool, StagingRange
from .streams import encode_layer_into, write_residual_into

logger = logging.getLogger(__name__)

# Request id of the identity announcement: above SGLang's bootstrap rooms (< 2**63).
IDENTITY_REQUEST = MAX_REQUEST_ID
_STREAMS = {WireStream.ANCHOR: Stream.ANCHOR, WireStream.RESIDUAL: Stream.RESIDUAL}


@dataclass(frozen=True)
class Destination:
    """One decode rank a room goes to: its transport address, how many KV slots it allocated, and
    SGLang's (endpoint, port) to notify."""

    session_address: str
    num_slots: int
    notify: tuple[str, int]


@dataclass(frozen=True)
class PrefillLink:
    """What the sender needs from SGLang's side of the manager (all thread-safe callables)."""

    # False once SGLang has failed or cleared the room: drop its work.
    is_live: Callable[[int], bool]
    # The room's decode destinations (dummy ranks excluded).
    destinations: Callable[[int], list[Destination]]
    # SGLang's aux data of the room (first output token, ...), packed for the wire.
    read_aux: Callable[[int], bytes]
    # The one status report: (room, None | failure reason, notify targets).
    report: Callable[[int, str | None, list[tuple[str, int]]], None]


@dataclass
class _Chunk:
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


class PrefillSender:
    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, endpoint: Endpoint, identity: dict, link: PrefillLink,
                 fault_residual_delay_s: float = 0.0):
        self.config = config
        self.spec: CodecSpec = config.codec
        self._pool = pool
        self.staging = staging
        self.staging_region = staging_region
        self.endpoint = endpoint
        self.identity = identity
        self.link = link
        self._fault_residual_delay_s = fault_residual_delay_s
        self._queue: queue.Queue[_Chunk] = queue.Queue()
        self._pending: dict[int, list[np.ndarray]] = {}
        self._inflight: list[_InFlight] = []
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()

    def submit(self, room: int, kv_indices, is_last: bool, aux_index: int | None,
               wait_event=None) -> None:
        """Queue one chunk of a room's KV slots (SGLang's scheduler thread; never blocks)."""
        if isinstance(kv_indices, torch.Tensor):
            kv_indices = kv_indices.cpu().numpy()
        self._queue.put(_Chunk(room, np.array(kv_indices, dtype=np.int64), is_last, aux_index,
                               wait_event))

    def run(self, stop: threading.Event) -> None:
        """The sender thread's loop."""
        while not stop.is_set():
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                item = None
            if item is not None:
                self._handle(item)
            self._reap()

    def _handle(self, item: _Chunk) -> None:
        room = item.room
        if not self.link.is_live(room):
            self._pending.pop(room, None)
            return
        if item.wait_event is not None:
            item.wait_event.synchronize()
        self._pending.setdefault(room, []).append(item.kv_indices)
        if not item.is_last:
            return
        slots = np.concatenate(self._pending.pop(room))
        try:
            self._send(room, slots, item.aux_index)
        except Exception as exc:
            logger.exception("lynx: sending room %s failed", room)
            self.link.report(room, f"lynx prefill send failed: {exc}", [])

    def _session_to(self, address: str) -> Session:
        with self._sessions_lock:
            s = self._sessions.get(address)
            if s is not None and not s.closed:
                return s
            s = self.endpoint.connect(address, timeout=self.config.connect_timeout_s)
            s.announce(IDENTITY_REQUEST, {}, meta=json.dumps(self.identity).encode())
            self._sessions[address] = s
            return s

    def _send(self, room: int, prefill_slots: np.ndarray, aux_index: int | None) -> None:
        destinations = self.link.destinations(room)
        if not destinations:
            self.link.report(room, None, [])
            return
        pool = self._pool()
        num_tokens = len(prefill_slots)
        plan = StreamPlan.build(self.spec, pool.shape, num_tokens, self.config.chunk_tokens)
        aux = self.link.read_aux(aux_index)
        slots = torch.as_tensor(prefill_slots, dtype=torch.int64, device=pool.device)
        for dst in destinations:
            if dst.num_slots != num_tokens:
                raise KVStreamError(f"decode allocated {dst.num_slots} KV slots for a request "
                                    f"of {num_tokens} tokens")
            session = self._session_to(dst.session_address)
            ann = session.wait_announcement(room, timeout=self.config.connect_timeout_s)
            for ws, stream in _STREAMS.items():
                if ann.stream_nbytes(stream) != plan.stream_bytes(ws):
                    raise KVStreamError(
                        f"decode announced {ann.stream_nbytes(stream)} B for the {ws.name} "
                        f"stream, this prefill encodes {plan.stream_bytes(ws)} B: the --lynx-* "
                        "flags or the model differ between prefill and decode")
            staging = self.staging.allocate(plan.staging_bytes,
                                            timeout_s=self.config.transfer_timeout_s)
            inflight = _InFlight(room, session, staging)
            self._inflight.append(inflight)
            try:
                self._write_streams(session, room, pool, slots, staging, plan, aux)
            except Exception:
                # A stream never written stays pending for the transport, so the reaper would
                # never free this range: give it back now.
                self._inflight.remove(inflight)
                _release(session, room)
                self.staging.free(staging)
                raise
        self.link.report(room, None, [d.notify for d in destinations])

    def _write_streams(self, session: Session, room: int, pool: KVPoolView, slots: torch.Tensor,
                       staging: StagingRange, plan: StreamPlan, aux: bytes) -> None:
        """Encode layer by layer straight into staging: each layer's Anchor chunks are written
        as soon as they are encoded; the Residual chunks are made only after the whole Anchor
        stream (and its aux) is finished, each layer's written as soon as it is placed."""
        buf = self.staging.buffer
        chunk_tokens = self.config.chunk_tokens
        encoded = []
        for layer in range(plan.num_layers):
            at = staging.offset + plan.anchor_offset(layer)
            written, layer_encoding = encode_layer_into(
                pool, layer, slots, self.spec, chunk_tokens, room,
                buf[at: at + plan.anchor_layer_bytes])
            if written != plan.anchor_layer_bytes:
                raise KVStreamError(f"layer {layer}: encoded {written} B of Anchor, "
                                    f"expected {plan.anchor_layer_bytes} B")
            session.write_stream(room, Stream.ANCHOR, self.staging_region, at,
                                 plan.anchor_layer_bytes, stream_offset=plan.anchor_offset(layer))
            encoded.append(layer_encoding)
        session.finish(room, Stream.ANCHOR, aux=aux)
        if self._fault_residual_delay_s:
            logger.warning("lynx: room %s Anchor finished; holding the Residual %.1f s (test "
                           "fault injection)", room, self._fault_residual_delay_s)
            time.sleep(self._fault_residual_delay_s)
        if not self.config.residual:
            return
        for layer, layer_encoding in enumerate(encoded):
            at = staging.offset + plan.residual_staging_offset(layer)
            written = write_residual_into(pool, layer_encoding, slots, chunk_tokens, room,
                                          buf[at: at + plan.residual_layer_bytes])
            if written != plan.residual_layer_bytes:
                raise KVStreamError(f"layer {layer}: encoded {written} B of Residual, "
                                    f"expected {plan.residual_layer_bytes} B")
            session.write_stream(room, Stream.RESIDUAL, self.staging_region, at,
                                 plan.residual_layer_bytes,
                                 stream_offset=plan.residual_offset(layer))
        session.finish(room, Stream.RESIDUAL)

    def _reap(self) -> None:
        """Free the staging of rooms the transport has delivered (or failed)."""
        streams = (Stream.ANCHOR, Stream.RESIDUAL) if self.config.residual else (Stream.ANCHOR,)
        keep = []
        for f in self._inflight:
            try:
                done = all(f.session.send_state(f.room, s).done for s in streams)
            except TransportError:
                done = True
            if not done:
                keep.append(f)
                continue
            _release(f.session, f.room)
            self.staging.free(f.staging)
        self._inflight = keep


def _release(session: Session, room: int) -> None:
    try:
        session.release(room)
    except TransportError as exc:
        logger.debug("lynx: release of room %s: %s", room, exc)
