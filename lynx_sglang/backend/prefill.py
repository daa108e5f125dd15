"""The prefill side of the `lynx` backend: `PrefillSender` encodes each finished request's KV into
its staging range and writes the two streams to the decode that announced it.

Per request ("room"):
1. SGLang queues the request's KV slots chunk by chunk (`submit`); the dispatcher thread (`run`)
   collects them, and at the last chunk (quantization groups and protected tokens span the full
   token range) hands the room to the worker thread of its decode (`_DestinationWorker`, one per
   decode address): a dead or slow decode delays only its own rooms, and after a failed connect
   its rooms fail at once for `UNREACHABLE_COOLDOWN_S`.
2. `_send` (the worker): the room's plan (`backend.plan.StreamPlan`) must match the decode's announcement
   (sizes of both streams; a mismatch means the two servers' `--lynx-*` flags or models differ);
   a staging range is allocated; `_RoomWriter` encodes each layer's Anchor straight into staging
   and writes it at once; after the whole Anchor (finished with SGLang's aux data: first token
   etc.), each layer's Residual. Then Success is reported: SGLang may free the room's KV slots,
   since staging holds everything still to be sent.
   Layer streaming (`start_early`, `backend.layer_stream`): the rooms of one forward go to their
   decode's worker as soon as the forward starts, as one group, and each layer is sent for every
   room of the group as the forward writes it (`send_group`).
3. The staging range lives until the transport has delivered both streams (`reap`).

Given by `backend.manager.LynxKVManager`: the pool view, the staging pool and its region, the
transport endpoint, the codec and serving config, and `PrefillLink` (what the sender asks SGLang's
side: is the room still live, where does it go, its aux bytes; and the one status report).
Buffer ownership: the staging range of a room belongs to its worker from `allocate` until `reap`
(or the failure path) frees it, after `Session.release` guarantees no byte is read again.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from lynx_kernels import CodecSpec, StreamKind, Target, WireStream
from lynx_transport import (
    AnnouncementTimeoutError,
    Endpoint,
    Region,
    Session,
    SessionClosedError,
    Stream,
    TransportError,
)
from lynx_transport.types import MAX_REQUEST_ID

from .. import metrics, trace
from ..config import LynxConfig
from ..errors import KVStreamError, RoomDroppedError, SettingsMismatchError, StagingFullError
from ..failures import failure_kind_of
from ..names import (
    FAULT_ANCHOR_DELAY_ENV,
    FAULT_ANCHOR_HOLD_LOG,
    FAULT_RESIDUAL_DELAY_ENV,
    FAULT_RESIDUAL_HOLD_LOG,
)
from .layer_stream import LayerGate, LayerGateError
from .plan import StreamPlan
from .pool import KINDS, KVPoolView
from .staging import StagingPool, StagingRange
from .streams import encode_layer_into
from .window import Segments

logger = logging.getLogger(__name__)

# Request id of the identity announcement: above SGLang's bootstrap rooms (< 2**63).
IDENTITY_REQUEST = MAX_REQUEST_ID
# After a failed connect to a decode, rooms bound there fail at once for this long.
UNREACHABLE_COOLDOWN_S = 5.0
# Rooms whose sent-byte count waits for SGLang to read it (it reads right after Success).
SENT_BYTES_KEPT = 4096
# How often a layer-streamed room waiting for SGLang's hand-over checks that SGLang still has it.
HANDOVER_POLL_S = 0.05
# How often a room waiting for prefill staging reaps its worker's delivered rooms.
STAGING_POLL_S = 0.05
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
    submitted: float
    trace_ctx: object | None = None  # SGLang's TraceReqContext of the request, if tracing


@dataclass
class _InFlight:
    """A sent room (or a windowed room's segment, by its request id) whose staging range must
    live until the transport has delivered it. `trace`: the record to complete and emit then
    (None for a windowed room's segments but its last)."""

    room: int
    session: Session
    staging: StagingRange
    trace: trace.Trace | None


@dataclass
class _Job:
    """A room whose last chunk arrived (or, layer-streamed, whose forward started): everything a
    destination worker needs to send it."""

    room: int
    slots: np.ndarray
    aux_index: int | None
    destinations: list[Destination]
    trace: trace.Trace
    # Layer-streamed (`start_early`): the forward's layers written so far, and SGLang's hand-over
    # of the room after the forward (`handed_over`; `refused` says why the room cannot be sent).
    gate: LayerGate | None = None
    handed_over: threading.Event = field(default_factory=threading.Event)
    refused: str | None = None
    # Held by the worker while it reads pool rows of `slots`, and by `_reconcile_streamed` while
    # it replaces slots SGLang's prefix cache swapped after the forward.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set by `_reconcile_streamed` when the swapped-in slots hold other bits: the forward's own.
    kept: _KeptRows | None = None
    # `slots` as last seen by `rows_of`, and as a tensor on the pool's device (one copy per
    # room, not per layer, on a CUDA pool).
    _on_device: tuple = (None, None)

    def rows_of(self, pool: KVPoolView, layer: int):
        """What `encode_layer_into` reads this layer from (under `lock`): the pool and the room's
        slots there, or, with `kept` rows, a gathered copy of the layer and its row numbers."""
        if self._on_device[0] is not self.slots:
            self._on_device = (self.slots, torch.as_tensor(self.slots, device=pool.device))
        if self.kept is None:
            return pool, self._on_device[1]
        return self.kept.layer_view(pool, layer, self._on_device[1]), self.kept.order


@dataclass
class _KeptRows:
    """Copies of the KV a layer-streamed forward wrote at the positions of its room whose slots
    SGLang's prefix cache swapped for cached slots holding other bits (two requests computed the
    same tokens in different batches). Made on the scheduler thread before the forward's slots
    can be written again, so the whole room is sent as its forward computed it: the KV its first
    token came from, and the Anchor layers already sent. Owned by the job, freed with it; at most
    the room's own KV at those positions."""

    positions: torch.Tensor  # into the room's slots
    k: list[torch.Tensor]  # per layer: [len(positions), kv_heads, head_dim]
    v: list[torch.Tensor]
    order: torch.Tensor  # 0..len(slots)-1: the rows of a `layer_view`, in slot order

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def layer_view(self, pool: KVPoolView, layer: int, slots: torch.Tensor) -> _LayerRows:
        k, v = (pool.read(layer, kind, slots) for kind in KINDS)
        k[self.positions] = self.k[layer]
        v[self.positions] = self.v[layer]
        return _LayerRows(layer, k, v)


@dataclass
class _LayerRows:
    """One layer of one room in slot order (`KVPoolView.layer`'s interface, that layer only)."""

    index: int
    k: torch.Tensor
    v: torch.Tensor

    def layer(self, layer: int, kind: StreamKind) -> torch.Tensor:
        assert layer == self.index, (layer, self.index)
        return self.k if kind is StreamKind.K else self.v


class _DestinationWorker:
    """Sends the rooms bound for one decode address, one group at a time (`send_group`), in its
    own thread: a dead or slow decode (connect, announcement and staging waits are bounded, but
    long) holds up only the rooms bound for it. Exits after `IDLE_EXIT_S` without work."""

    IDLE_EXIT_S = 60.0

    def __init__(self, sender: PrefillSender, address: str):
        self.sender = sender
        self.address = address
        self.jobs: queue.Queue[list[_Job]] = queue.Queue()
        self.inflight: list[_InFlight] = []
        self.thread = threading.Thread(target=self._run, name=f"lynx-send-{address[-12:]}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while not self.sender.stopping.is_set():
            try:
                group = self.jobs.get(timeout=0.05)
            except queue.Empty:
                group = None
            try:
                if group is not None:
                    idle_since = time.monotonic()
                    self.sender.send_group(group, self.inflight)
                self.sender.reap(self.inflight)
            except Exception:
                logger.exception("lynx: prefill sender error (continuing)")
            if (group is None and not self.inflight and self.jobs.empty()
                    and time.monotonic() - idle_since > self.IDLE_EXIT_S
                    and self.sender.retire(self)):
                return


def _encode(sender: PrefillSender, job: _Job, pool: KVPoolView, layer: int, anchor_out,
            residual_out) -> tuple[int, int]:
    """Encode one layer of the job's slots (`encode_layer_into`)."""
    # Under the job's lock: the slots may be swapped for the prefix cache's between layers
    # (`_reconcile_streamed`), never during one.
    with job.lock:
        rows, index = job.rows_of(pool, layer)
        return encode_layer_into(rows, layer, index, sender.spec, sender.config.chunk_tokens,
                                 job.room, anchor_out, residual_out, sender.encoder)


class _RoomWriter:
    """Writes one room's two streams to one decode from its staging range, layer by layer
    (`layer`, in order), then ends the Anchor (`finish_anchor`) and the Residual
    (`finish_residual`). Split in steps so that a destination worker can interleave the rooms of
    one forward (`send_group`): layer by layer, every Anchor ended before any Residual.

    Each layer is encoded straight into staging and its Anchor written at once. After the
    forward, every layer's Anchor (and the aux) goes before any Residual byte: an int8 Residual
    is cheap and of fixed size, so it is encoded in the same pass, at its place; an exact
    Residual costs ~10x its Anchor, so it is encoded in a second pass, after the whole Anchor is
    out, each layer written as soon as it is placed. Layer-streamed (during the forward, as soon
    as the forward has written the layer), each layer's Residual is encoded in the Anchor's pass
    and written with it."""

    def __init__(self, sender: PrefillSender, session: Session, job: _Job, pool: KVPoolView,
                 staging: StagingRange, plan: StreamPlan):
        self.sender, self.session, self.job, self.pool = sender, session, job, pool
        self.staging, self.plan = staging, plan
        config = sender.config
        self.residual_base = staging.offset + plan.anchor_bytes
        # Layer-streamed, the Residual goes out with its layer too: the forward of the later
        # layers leaves the time (and the link idle between Anchor layers), and the transport
        # still sends the Anchor first. Not with the test knob that holds the Residual back.
        self.stream_residual = (config.residual and job.gate is not None
                                and not sender.faults.residual_s)
        self.one_pass = config.residual and (sender.spec.target is Target.INT8
                                             or self.stream_residual)
        job.trace.facts.update(one_pass=self.one_pass, residual_streamed=self.stream_residual)
        self.residual_at = 0  # stream offset of the next streamed Residual layer
        self.posted = 0  # bytes of both streams, once `finish_residual` has run
        job.trace.mark("encode_start")

    def run(self) -> int:
        for layer in range(self.plan.num_layers):
            self.layer(layer)
        self.finish_anchor()
        return self.finish_residual()

    def _encode(self, layer: int, anchor_out, residual_out) -> tuple[int, int]:
        return _encode(self.sender, self.job, self.pool, layer, anchor_out, residual_out)

    def layer(self, layer: int) -> None:
        job, plan, room = self.job, self.plan, self.job.room
        buf, region = self.sender.staging.buffer, self.sender.staging_region
        if job.gate is not None:
            job.gate.wait(layer, self.sender.config.transfer_timeout_s)
            # An aborted request's slots are freed right after its forward, and may be written
            # by the next one: stop reading them.
            if not self.sender.link.is_live(room):
                raise RoomDroppedError("SGLang dropped the room during its forward")
        t0 = time.time()
        at = self.staging.offset + plan.anchor_offset(layer)
        r_at = self.residual_base + layer * plan.residual_layer_bytes
        written, r_written = self._encode(
            layer, buf[at: at + plan.anchor_layer_bytes],
            buf[r_at: r_at + plan.residual_layer_bytes] if self.one_pass else None)
        if written != plan.anchor_layer_bytes:
            raise KVStreamError(f"layer {layer}: encoded {written} B of Anchor, "
                                f"expected {plan.anchor_layer_bytes} B")
        self.session.write_stream(room, Stream.ANCHOR, region, at, plan.anchor_layer_bytes,
                                  stream_offset=plan.anchor_offset(layer))
        if self.stream_residual:
            # An exact layer is as long as its values need: the layers go back to back on the
            # stream, each from its own (bound-sized) place in staging.
            self.session.write_stream(room, Stream.RESIDUAL, region, r_at, r_written,
                                      stream_offset=self.residual_at)
            self.residual_at += r_written
        job.trace.span("encode_anchor", layer, t0, time.time())
        if layer + 1 == plan.num_layers // 2:
            self.sender.fault_hold_anchor(room, layer + 1, plan.num_layers)

    def finish_anchor(self) -> None:
        """After every layer: the Anchor's end, with the aux (layer-streamed: once SGLang has
        handed the room over after the forward)."""
        sender, job = self.sender, self.job
        if job.gate is not None:
            job.trace.mark("anchor_layers_posted")
            sender.await_handover(job)
        self.session.finish(job.room, Stream.ANCHOR, aux=sender.link.read_aux(job.aux_index))
        job.trace.mark("anchor_posted")

    def finish_residual(self) -> int:
        """After `finish_anchor`: the rest of the Residual and its end. Returns the bytes
        posted, both streams."""
        sender, session, job, plan = self.sender, self.session, self.job, self.plan
        room, tr, config = job.room, job.trace, sender.config
        buf, region = sender.staging.buffer, sender.staging_region
        sender.fault_hold_residual(room)
        if not config.residual:
            tr.mark("encode_end")
            self.posted = plan.anchor_bytes
            return self.posted
        if self.stream_residual:
            stream_at = self.residual_at
        elif self.one_pass:
            session.write_stream(room, Stream.RESIDUAL, region, self.residual_base,
                                 plan.residual_bytes, stream_offset=0)
            stream_at = plan.residual_bytes
        else:
            # The second pass encodes the Anchor again (the corrections are relative to it) into
            # scratch; the layers go back to back, each as long as its values need.
            scratch = np.empty(plan.anchor_layer_bytes, dtype=np.uint8)
            stream_at = 0
            for layer in range(plan.num_layers):
                t0 = time.time()
                at = self.residual_base + stream_at
                _, written = self._encode(layer, scratch, buf[at: at + plan.residual_layer_bytes])
                session.write_stream(room, Stream.RESIDUAL, region, at, written,
                                     stream_offset=stream_at)
                stream_at += written
                tr.span("encode_residual", layer, t0, time.time())
        session.finish(room, Stream.RESIDUAL)
        tr.mark("residual_posted")
        tr.mark("encode_end")
        self.posted = plan.anchor_bytes + stream_at
        return self.posted


class _WindowedWriter:
    """Writes a windowed room (`backend.window`; the decode announced it in segments): segment
    after segment, once the decode has announced it, each encoded into its own prefill staging
    range, both streams written and finished, the range handed to the reaper (`inflight`). The
    decode announces a segment only when a window is free, so this waits for it (bounded by the
    transfer timeout). Sent after the forward: `layer` does nothing, everything happens in
    `finish_residual`, so in a layer-streamed group the room waits for the others' Anchors."""

    def __init__(self, sender: PrefillSender, session: Session, job: _Job, pool: KVPoolView,
                 plan: StreamPlan, segments: Segments, inflight: list[_InFlight]):
        self.sender, self.session, self.job, self.pool = sender, session, job, pool
        self.plan, self.segments, self.inflight = plan, segments, inflight
        self.posted = 0
        job.trace.facts.update(one_pass=True, residual_streamed=False)

    def run(self) -> int:
        self.finish_anchor()
        return self.finish_residual()

    def layer(self, layer: int) -> None:
        """Nothing yet (see the class)."""

    def finish_anchor(self) -> None:
        if self.job.gate is not None:
            self.sender.await_handover(self.job)  # every layer is in the pool after it

    def finish_residual(self) -> int:
        sender, session, job, seg = self.sender, self.session, self.job, self.segments
        tr = job.trace
        tr.mark("encode_start")
        for j in range(seg.count):
            request_id = seg.request_id(job.room, j)
            plan = seg.plan(self.plan, j)
            ann = self._wait_announcement(request_id, j)
            _check_announcement(ann, plan)
            staging = sender._allocate(plan.staging_bytes, self.inflight)
            last = j + 1 == seg.count
            try:
                posted = self._segment(request_id, plan, seg.layers(j), staging, last)
            except BaseException:
                _release(session, request_id)
                sender.staging.free(staging)
                raise
            self.inflight.append(_InFlight(request_id, session, staging, tr if last else None))
            self.posted += posted
            if j == 0 and not last:
                sender.fault_hold_residual(job.room)  # between the first segment and the next
        tr.mark("encode_end")
        return self.posted

    def _wait_announcement(self, request_id: int, j: int):
        """Segment j's announcement, within the transfer timeout; a room SGLang dropped
        meanwhile (the decode aborted it) stops at once instead of holding this worker."""
        sender, room = self.sender, self.job.room
        timeout = sender.config.transfer_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if not sender.link.is_live(room):
                raise RoomDroppedError(f"SGLang dropped the room before its segment {j} was sent")
            left = deadline - time.monotonic()
            try:
                return self.session.wait_announcement(
                    request_id, timeout=max(min(left, HANDOVER_POLL_S), 0.0))
            except AnnouncementTimeoutError:
                if left <= HANDOVER_POLL_S:
                    raise AnnouncementTimeoutError(
                        f"the decode did not announce segment {j} of the room within "
                        f"{timeout:g} s") from None

    def _segment(self, request_id: int, plan: StreamPlan, layers: range, staging: StagingRange,
                 last: bool) -> int:
        """Encode and write one segment from `staging`; returns its bytes, both streams."""
        sender, session, job = self.sender, self.session, self.job
        buf, region, residual = sender.staging.buffer, sender.staging_region, sender.config.residual
        residual_at = staging.offset + plan.anchor_bytes
        r_len = 0
        for i, layer in enumerate(layers):
            t0 = time.time()
            at = staging.offset + plan.anchor_offset(i)
            r_at = residual_at + r_len
            written, r_written = _encode(
                sender, job, self.pool, layer, buf[at: at + plan.anchor_layer_bytes],
                buf[r_at: r_at + plan.residual_layer_bytes] if residual else None)
            if written != plan.anchor_layer_bytes:
                raise KVStreamError(f"layer {layer}: encoded {written} B of Anchor, "
                                    f"expected {plan.anchor_layer_bytes} B")
            r_len += r_written
            job.trace.span("encode_anchor", layer, t0, time.time())
        session.write_stream(request_id, Stream.ANCHOR, region, staging.offset, plan.anchor_bytes,
                             stream_offset=0)
        session.finish(request_id, Stream.ANCHOR,
                       aux=sender.link.read_aux(job.aux_index) if last else b"")
        if last:
            job.trace.mark("anchor_posted")
        if residual:
            session.write_stream(request_id, Stream.RESIDUAL, region, residual_at, r_len,
                                 stream_offset=0)
            session.finish(request_id, Stream.RESIDUAL)
            if last:
                job.trace.mark("residual_posted")
        return plan.anchor_bytes + r_len


@dataclass(frozen=True)
class FaultHolds:
    """The prefill's test-only holds (`lynx-sglang faults`; 0, the default, is off), in s:
    `anchor_s` holds a room's Anchor after the first half of its layers, `residual_s` its
    Residual after its Anchor (a windowed room's: after its first segment)."""

    anchor_s: float = 0.0
    residual_s: float = 0.0

    @classmethod
    def from_env(cls) -> FaultHolds:
        def seconds(name: str) -> float:
            raw = os.environ.get(name, "") or "0"
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 s, got {raw!r}")
            return value

        return cls(seconds(FAULT_ANCHOR_DELAY_ENV), seconds(FAULT_RESIDUAL_DELAY_ENV))


class PrefillSender:
    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, endpoint: Endpoint, identity: dict, link: PrefillLink,
                 faults: FaultHolds = FaultHolds()):
        self.config = config
        self.spec: CodecSpec = config.codec
        self._pool = pool
        self.staging = staging
        self.staging_region = staging_region
        self.endpoint = endpoint
        self.identity = identity
        self.link = link
        self.faults = faults
        # Ends the holds early once set: by in-process tests, which then need no timing margin,
        # and at shutdown.
        self.fault_release = threading.Event()
        self._queue: queue.Queue[list[_Chunk]] = queue.Queue()
        # Chunks submitted inside `batched` (scheduler thread only), queued together at its end.
        self._held: list[_Chunk] | None = None
        self._pending: dict[int, list[np.ndarray]] = {}
        # Layer-streamed rooms whose forward runs or has not been handed over yet.
        self._early: dict[int, _Job] = {}
        self._early_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._workers: dict[str, _DestinationWorker] = {}
        self._workers_lock = threading.Lock()
        # Decode addresses a connect failed to, with when they may be tried again: rooms bound
        # there fail at once instead of each waiting out the connect timeout.
        self._unreachable: dict[str, float] = {}
        # Bytes each successful room put on the wire, for SGLang's transfer metrics (read once
        # by `take_sent_bytes`; capped, since an aborted request's entry is never read).
        self._sent_bytes: OrderedDict[int, int] = OrderedDict()
        self._sent_lock = threading.Lock()
        self.stopping = threading.Event()
        # Shared by every destination worker: a layer's V is encoded while its K is.
        self.encoder = (ThreadPoolExecutor(1, thread_name_prefix="lynx-encode")
                        if config.encode_threads > 1 else None)

    def tracked(self) -> dict[str, int]:
        """Rooms this sender still holds (0 on an idle prefill; `lynx_tracked_requests`)."""
        with self._workers_lock:
            workers = list(self._workers.values())
        return {"prefill_pending_chunks": len(self._pending),
                "prefill_rooms_streaming": len(self._early),
                "prefill_rooms_in_flight": sum(len(w.inflight) + w.jobs.qsize() for w in workers)}

    def start_early(self, rooms: list[tuple[int, np.ndarray]], gate: LayerGate) -> set[int]:
        """SGLang's scheduler thread, as a forward that computes the whole prompt of each
        (room, slots) in `rooms` starts: queue those rooms now, each Anchor layer to be sent once
        `gate` has it. Returns the rooms queued; the others go the usual way after the forward.
        A room is queued only if it goes to exactly one decode, known now, that allocated as
        many slots. The rooms bound for one decode go to its worker as one group, which it sends
        layer by layer across the group (`send_group`): every room's first layers go out while
        the forward computes, not one room after another's whole transfer."""
        jobs: list[_Job] = []
        for room, slots in rooms:
            destinations = self.link.destinations(room) if self.link.is_live(room) else []
            if len(destinations) != 1 or destinations[0].num_slots != len(slots):
                continue
            tr = trace.Trace("prefill", room)
            tr.facts["layer_streamed"] = True
            job = _Job(room, slots, None, destinations, tr, gate=gate)
            with self._early_lock:
                if room in self._early:
                    continue
                self._early[room] = job
            jobs.append(job)
        for group in _by_decode(jobs):
            for job in group:
                job.trace.facts["streamed_with_rooms"] = len(group)
            self._dispatch(group)
        return {job.room for job in jobs}

    def submit(self, room: int, kv_indices, is_last: bool, aux_index: int | None,
               wait_event=None, trace_ctx=None) -> None:
        """Queue one chunk of a room's KV slots (SGLang's scheduler thread; waits at most for
        one layer's encode of a layer-streamed room, see `_reconcile_streamed`)."""
        if isinstance(kv_indices, torch.Tensor):
            kv_indices = kv_indices.cpu().numpy()
        kv_indices = np.array(kv_indices, dtype=np.int64)
        if is_last:
            self._reconcile_streamed(room, kv_indices)
        chunk = _Chunk(room, kv_indices, is_last, aux_index, wait_event, time.time(), trace_ctx)
        if self._held is not None:
            self._held.append(chunk)
        else:
            self._queue.put([chunk])

    @contextmanager
    def batched(self) -> Iterator[None]:
        """SGLang's scheduler thread, around its handling of one forward's results: the chunks
        `submit`ted inside reach the dispatcher together, so the rooms they complete that go to
        one decode reach its worker as one group (`send_group`: every room's Anchor before any
        Residual) instead of one after another's whole transfer."""
        if self._held is not None:  # nested: the outer one sends them
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._queue.put(held)

    def _reconcile_streamed(self, room: int, tail: np.ndarray) -> None:
        """A layer-streamed room's last chunk, on the scheduler thread, before any slot SGLang
        freed since the forward can be written again. SGLang's prefix cache may have replaced
        slots the forward wrote by cached ones holding the same tokens (seen: a fully cached
        prompt whose last token is computed again; two requests computing the same tokens at
        once) and freed the forward's. The room goes on with the cached slots; where they hold
        other bits in any layer, the forward's rows there are copied first (`_KeptRows`), so the
        room is sent as its forward computed it and the Anchor already sent stays right."""
        with self._early_lock:
            job = self._early.get(room)
        if job is None or len(tail) > len(job.slots):
            return
        start = len(job.slots) - len(tail)
        old = job.slots[start:]
        differ = np.nonzero(old != tail)[0]
        if not len(differ):
            return
        pool = self._pool()
        was = torch.as_tensor(old[differ], device=pool.device)
        now = torch.as_tensor(tail[differ], device=pool.device)
        layers = range(pool.shape.num_layers)
        with job.lock:
            same = all(torch.equal(pool.read(layer, kind, was), pool.read(layer, kind, now))
                       for layer in layers for kind in KINDS)
            if not same:
                job.kept = _KeptRows(
                    torch.as_tensor(start + differ, device=pool.device),
                    [pool.read(layer, StreamKind.K, was) for layer in layers],
                    [pool.read(layer, StreamKind.V, was) for layer in layers],
                    torch.arange(len(job.slots), device=pool.device))
            slots = job.slots.copy()
            slots[start:] = tail
            job.slots = slots
        if same:
            logger.debug("lynx: room %s: %d slots replaced by the prefix cache's (same KV)",
                         room, len(differ))
        else:
            logger.info("lynx: room %s: SGLang's prefix cache replaced %d of the slots its "
                        "forward wrote by cached ones holding other bits; sending the "
                        "forward's own KV there (%.1f MiB kept)", room, len(differ),
                        job.kept.nbytes / 2**20)

    def fault_hold_residual(self, room: int) -> None:
        """The test-only Residual hold (`FaultHolds.residual_s`): after a room's Anchor, or
        after a windowed room's first segment; `fault_release` ends it early."""
        if self.faults.residual_s:
            logger.warning("lynx: room %s %s %.1f s (test fault injection)", room,
                           FAULT_RESIDUAL_HOLD_LOG, self.faults.residual_s)
            self.fault_release.wait(self.faults.residual_s)

    def fault_hold_anchor(self, room: int, written: int, layers: int) -> None:
        """The test-only Anchor hold (`FaultHolds.anchor_s`): after `written` of a room's
        `layers` Anchor layers are on the wire; `fault_release` ends it early."""
        if self.faults.anchor_s:
            logger.warning("lynx: room %s %s after %d of %d layers for %.1f s (test fault "
                           "injection)", room, FAULT_ANCHOR_HOLD_LOG, written, layers,
                           self.faults.anchor_s)
            self.fault_release.wait(self.faults.anchor_s)

    def take_sent_bytes(self, room: int) -> int | None:
        """The Anchor + Residual bytes sent for `room` (every destination), once; None if the
        room was not sent (failed, or already taken)."""
        with self._sent_lock:
            return self._sent_bytes.pop(room, None)

    def _record_sent(self, room: int, nbytes: int) -> None:
        with self._sent_lock:
            self._sent_bytes[room] = nbytes
            while len(self._sent_bytes) > SENT_BYTES_KEPT:
                self._sent_bytes.popitem(last=False)

    def run(self, stop: threading.Event) -> None:
        """The dispatcher thread's loop: collect each room's chunks and hand the complete room to
        its destination's worker. A bug in handling one request must not stop the thread that
        serves every other one: it is logged and the loop goes on."""
        while not stop.is_set():
            try:
                items = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            ready: list[_Job] = []
            for item in items:
                try:
                    job = self._handle(item)
                except Exception:
                    logger.exception("lynx: prefill dispatcher error (continuing)")
                    continue
                if job is not None:
                    ready.append(job)
            for group in _by_decode(ready):
                self._dispatch(group)
        self.stopping.set()
        self.fault_release.set()
        if self.encoder is not None:
            self.encoder.shutdown(wait=False, cancel_futures=True)

    def retire(self, worker: _DestinationWorker) -> bool:
        """An idle worker asks to exit; False if a job raced in."""
        with self._workers_lock:
            if not worker.jobs.empty():
                return False
            self._workers.pop(worker.address, None)
            return True

    def _handle(self, item: _Chunk) -> _Job | None:
        """Take one chunk; returns the room's job once its last chunk completes it, if it is to
        be sent now (a layer-streamed room is already with its worker)."""
        room = item.room
        if not self.link.is_live(room):
            self._pending.pop(room, None)
            self._hand_over(room, None, None, "SGLang dropped the room")
            return None
        if item.wait_event is not None:
            item.wait_event.synchronize()
        self._pending.setdefault(room, []).append(item.kv_indices)
        if not item.is_last:
            return None
        slots = np.concatenate(self._pending.pop(room))
        if self._hand_over(room, item, slots, None):
            return None
        tr = trace.Trace("prefill", room, sglang_ctx=item.trace_ctx)
        tr.mark("submitted", item.submitted)
        destinations = self.link.destinations(room)
        if not destinations:
            self.link.report(room, None, [])
            return None
        return _Job(room, slots, item.aux_index, destinations, tr)

    def _hand_over(self, room: int, item: _Chunk | None, slots: np.ndarray | None,
                   refused: str | None) -> bool:
        """SGLang hands over (or drops) a room whose forward streamed its layers: give its job
        the aux index, or the reason it cannot be sent. False if the room was not streamed."""
        with self._early_lock:
            job = self._early.pop(room, None)
        if job is None:
            return False
        if item is not None:
            job.trace.mark("submitted", item.submitted)
            job.trace.sglang_ctx = item.trace_ctx
            job.aux_index = item.aux_index
            if job.refused is None and not np.array_equal(slots, job.slots):
                refused = (f"SGLang handed over {len(slots)} KV slots that differ from the "
                           f"{len(job.slots)} its forward wrote")
        job.refused = job.refused or refused
        job.handed_over.set()
        return True

    def _dispatch(self, jobs: list[_Job]) -> None:
        """Queue rooms bound for one decode address to its worker, as one group."""
        address = jobs[0].destinations[0].session_address
        with self._workers_lock:
            worker = self._workers.get(address)
            if worker is None:
                worker = self._workers[address] = _DestinationWorker(self, address)
            worker.jobs.put(jobs)

    def send_group(self, jobs: list[_Job], inflight: list[_InFlight]) -> None:
        """A destination worker sends a group of rooms: one, or the rooms of one forward bound
        for its decode (`start_early`, `batched`). A failure fails its own room only."""
        if len(jobs) == 1:
            self.send_job(jobs[0], inflight)
            return
        # One decode each: open every room, then send layer l of every room before layer l + 1
        # of any, so that each room's Anchor goes out as the forward writes it (one room after
        # another, the second's whole encode came after the forward); then end every room's
        # Anchor before any room's Residual (an exact one is encoded then).
        writers: list[tuple[_RoomWriter | _WindowedWriter, _InFlight | None]] = []
        for job in jobs:
            job.trace.mark("dequeued")
            try:
                writers.append(self._open(job, job.destinations[0], inflight))
            except Exception as exc:
                self._fail_room(job, exc)
        for layer in range(self._pool().shape.num_layers):
            self._each(writers, inflight, lambda w, layer=layer: w.layer(layer))
        self._each(writers, inflight, lambda w: w.finish_anchor())
        self._each(writers, inflight, lambda w: w.finish_residual())
        for w, _ in writers:
            try:
                self._done(w.job, w.posted, w.job.destinations)
            except Exception as exc:
                self._fail_room(w.job, exc)
        for job in jobs:
            self._forget_early(job)

    def _each(self, writers: list[tuple[_RoomWriter | _WindowedWriter, _InFlight | None]],
              inflight: list[_InFlight], step: Callable[[_RoomWriter | _WindowedWriter], object]
              ) -> None:
        """One step of every room of a group; a room whose step raises gives its staging and
        announcement back, fails, and leaves the group."""
        for w, f in list(writers):
            try:
                step(w)
            except Exception as exc:
                self._undo(f, inflight)
                self._fail_room(w.job, exc)
                writers.remove((w, f))

    def send_job(self, job: _Job, inflight: list[_InFlight]) -> None:
        """A destination worker sends one room (its failure fails that room only)."""
        job.trace.mark("dequeued")
        try:
            self._send(job, inflight)
        except Exception as exc:
            self._fail_room(job, exc)
        finally:
            self._forget_early(job)

    def _fail_room(self, job: _Job, exc: Exception) -> None:
        logger.error("lynx: sending room %s failed: %s", job.room, exc,
                     exc_info=not isinstance(exc, (TransportError, LayerGateError)))
        job.trace.facts["failure"] = str(exc)
        metrics.record_failure(failure_kind_of(exc))
        trace.emit(job.trace)
        self.link.report(job.room, f"lynx prefill send failed: {exc}", [])
        self._forget_early(job)

    def _forget_early(self, job: _Job) -> None:
        with self._early_lock:
            if self._early.get(job.room) is job:
                del self._early[job.room]

    def await_handover(self, job: _Job) -> None:
        """Layer-streamed: wait until SGLang hands the room over after its forward (the aux data,
        the first token, exists only then), or drops it."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while not job.handed_over.wait(HANDOVER_POLL_S):
            if not self.link.is_live(job.room):
                raise RoomDroppedError("SGLang dropped the room during its forward")
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang did not hand the room over within "
                                   f"{self.config.transfer_timeout_s:g} s of its forward")
        if job.refused is not None:
            raise KVStreamError(job.refused)

    def _session_to(self, address: str) -> Session:
        with self._sessions_lock:
            s = self._sessions.get(address)
            if s is not None and not s.closed:
                return s
            retry_at = self._unreachable.get(address)
            if retry_at is not None and time.monotonic() < retry_at:
                raise SessionClosedError(
                    f"decode {address} was unreachable {UNREACHABLE_COOLDOWN_S:g} s ago or less "
                    f"(next try in {retry_at - time.monotonic():.1f} s)")
        # Connect outside the lock: another destination's worker must not wait for this one.
        s = None
        try:
            s = self.endpoint.connect(address, timeout=self.config.connect_timeout_s)
            s.announce(IDENTITY_REQUEST, {}, meta=json.dumps(self.identity).encode())
            why = refusal(s.wait_announcement(IDENTITY_REQUEST,
                                              timeout=self.config.connect_timeout_s))
        except TransportError as exc:
            if "TLS" in str(exc):
                # the transport's TLS refusals (mismatch, certificates, alerts) in the
                # operator's terms, the failure's kind kept
                exc = type(exc)(f"{exc}; prefill and decode need TLS alike: "
                                "--lynx-tls-cert/--lynx-tls-key/--lynx-tls-ca with "
                                "certificates of one CA, the decode's naming its address")
            if s is not None:
                # Connected but never answered (a stalled decode): nobody else holds this
                # session, so it would stay open, with its sockets, until the peer dies.
                s.close()
            with self._sessions_lock:
                self._unreachable[address] = time.monotonic() + UNREACHABLE_COOLDOWN_S
            raise exc from None
        if why is not None:
            s.close()
            raise SettingsMismatchError(f"decode {address} refused this prefill: {why}")
        with self._sessions_lock:
            self._unreachable.pop(address, None)
            self._sessions[address] = s
        return s

    def _send(self, job: _Job, inflight: list[_InFlight]) -> None:
        sent = 0
        for dst in job.destinations:
            writer, f = self._open(job, dst, inflight)
            try:
                sent += writer.run()
            except Exception:
                self._undo(f, inflight)
                raise
        self._done(job, sent, job.destinations)

    def _open(self, job: _Job, dst: Destination, inflight: list[_InFlight]
              ) -> tuple[_RoomWriter, _InFlight] | tuple[_WindowedWriter, None]:
        """Ready `job`'s streams to `dst`: the session, the decode's announcement (checked
        against this prefill's plan) and a staging range, held in `inflight` from here on; or,
        when the decode announced the room in segments, its `_WindowedWriter`."""
        room, tr = job.room, job.trace
        pool = self._pool()
        num_tokens = len(job.slots)
        plan = StreamPlan.build(self.spec, pool.shape, num_tokens, self.config.chunk_tokens)
        tr.facts.update(tokens=num_tokens, anchor_bytes=plan.anchor_bytes,
                        residual_bytes=plan.residual_bytes if self.config.residual else 0)
        if dst.num_slots != num_tokens:
            raise SettingsMismatchError(f"decode allocated {dst.num_slots} KV slots for a "
                                        f"request of {num_tokens} tokens")
        session = self._session_to(dst.session_address)
        ann = session.wait_announcement(room, timeout=self.config.connect_timeout_s)
        tr.mark("announcement")
        segments = Segments.parse(ann.meta, plan.num_layers)
        if segments is not None:
            tr.facts.update(segments=segments.count)
            return _WindowedWriter(self, session, job, pool, plan, segments, inflight), None
        _check_announcement(ann, plan)
        staging = self._allocate(plan.staging_bytes, inflight)
        f = _InFlight(room, session, staging, tr)
        writer = _RoomWriter(self, session, job, pool, staging, plan)
        inflight.append(f)
        return writer, f

    def _allocate(self, nbytes: int, inflight: list[_InFlight]) -> StagingRange:
        """A staging range, waiting up to the transfer timeout. While it waits, this worker's own
        delivered rooms are reaped: their ranges are what it waits for (the worker reaps only
        between groups, so a plain wait held them until it timed out)."""
        timeout = self.config.transfer_timeout_s
        deadline = time.monotonic() + timeout
        # try_allocate raises at once for a request larger than the whole pool.
        while (staging := self.staging.try_allocate(nbytes)) is None:
            self.reap(inflight)
            left = deadline - time.monotonic()
            if left <= 0:
                raise StagingFullError(
                    f"no {nbytes} B of staging free within {timeout:g} s "
                    f"({self.staging.free_bytes()} B free): raise --lynx-staging-mib on the "
                    "prefill, or admit fewer concurrent requests")
            self.staging.wait_for_free(min(left, STAGING_POLL_S))
        return staging

    def _undo(self, f: _InFlight | None, inflight: list[_InFlight]) -> None:
        """A room whose streams failed before they were all written: a stream never written
        stays pending for the transport, so the reaper would never free its range. (None: a
        windowed room, whose writer gives back its own unfinished segment.)"""
        if f is None:
            return
        inflight.remove(f)
        _release(f.session, f.room)
        self.staging.free(f.staging)

    def _done(self, job: _Job, sent: int, destinations: list[Destination]) -> None:
        self._record_sent(job.room, sent)
        self.link.report(job.room, None, [d.notify for d in destinations])
        job.trace.mark("reported")

    def reap(self, inflight: list[_InFlight]) -> None:
        """Free the staging of rooms the transport has delivered (or failed)."""
        streams = (Stream.ANCHOR, Stream.RESIDUAL) if self.config.residual else (Stream.ANCHOR,)
        keep = []
        for f in inflight:
            try:
                done = all(f.session.send_state(f.room, s).done for s in streams)
            except TransportError:
                done = True
            if not done:
                keep.append(f)
                continue
            _release(f.session, f.room)
            self.staging.free(f.staging)
            if f.trace is not None:
                self._trace_streams(f, streams)
                trace.emit(f.trace)
        inflight[:] = keep

    @staticmethod
    def _trace_streams(f: _InFlight, streams: tuple[Stream, ...]) -> None:
        for stream in streams:
            name = "anchor" if stream is Stream.ANCHOR else "residual"
            try:
                st = f.session.send_state(f.room, stream)
            except TransportError:
                continue
            f.trace.mark_mono(f"{name}_first_sent", st.t_first_byte)
            if st.ok:
                f.trace.mark_mono(f"{name}_acked", st.t_done)
            elif st.reason is not None:
                f.trace.facts[f"{name}_failure"] = f"{st.reason.value} {st.detail}"


def refusal(answer) -> str | None:
    """Why the decode refused this prefill's session, from its answer to the identity
    announcement (`{"accepted": true}` or `{"refused": why}`); an answer that is neither is a
    refusal too."""
    try:
        said = json.loads(bytes(answer.meta))
    except ValueError:
        said = None
    if isinstance(said, dict) and said.get("accepted") is True:
        return None
    why = said.get("refused") if isinstance(said, dict) else None
    return why if isinstance(why, str) else f"unintelligible answer {bytes(answer.meta[:100])!r}"


def _by_decode(jobs: list[_Job]) -> list[list[_Job]]:
    """Rooms grouped by the decode address of their worker, in order; a room with several
    destinations goes alone (a group sends to one decode each)."""
    groups: dict[str, list[_Job]] = {}
    alone: list[list[_Job]] = []
    for job in jobs:
        if len(job.destinations) == 1:
            groups.setdefault(job.destinations[0].session_address, []).append(job)
        else:
            alone.append([job])
    return alone + list(groups.values())


def _check_announcement(ann, plan: StreamPlan) -> None:
    """The decode announced the stream sizes this prefill encodes for `plan`."""
    for ws, stream in _STREAMS.items():
        if ann.stream_nbytes(stream) != plan.stream_bytes(ws):
            raise SettingsMismatchError(
                f"decode announced {ann.stream_nbytes(stream)} B for the {ws.name} "
                f"stream, this prefill encodes {plan.stream_bytes(ws)} B: the --lynx-* "
                "flags or the model differ between prefill and decode")


def _release(session: Session, room: int) -> None:
    try:
        session.release(room)
    except TransportError as exc:
        logger.debug("lynx: release of room %s: %s", room, exc)
