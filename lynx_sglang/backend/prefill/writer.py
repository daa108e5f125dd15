"""How one room's two streams are written to one decode from prefill staging: `RoomWriter` (the
room's staging range holds both whole streams) and `WindowedWriter` (the decode announced the
room in segments, `backend.window`). Made and driven by the room's destination worker
(`backend.prefill.worker`), on its thread, step by step (`layer` for each layer in order, then
`finish_anchor`, then `finish_residual`), so that the worker can interleave the rooms of one
forward. Everything a writer needs besides the room comes in `WriterDeps`.

Buffer ownership: a writer encodes into staging ranges its worker allocated
(`backend.prefill.inflight.InFlightStaging`) and never frees them; a `WindowedWriter` allocates its
segments' ranges from that same worker's staging and hands each to it once written.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from lynx_kernels import CodecSpec, Target, WireStream
from lynx_transport import AnnouncementTimeoutError, Region, Session, Stream

from ...config import LynxConfig
from ...errors import KVStreamError, RoomDroppedError, SettingsMismatchError
from ..plan import StreamPlan
from ..pool import KVPoolView
from ..staging import StagingPool, StagingRange
from ..streams import PendingLayer, encode_layer_start
from ..window import Segments
from .faults import FaultPlan, Point
from .inflight import InFlight, InFlightStaging, release_request
from .job import HANDOVER_POLL_S, Job

_STREAMS = {WireStream.ANCHOR: Stream.ANCHOR, WireStream.RESIDUAL: Stream.RESIDUAL}


@dataclass(frozen=True)
class WriterDeps:
    """What every room writer of a prefill shares (given by `PrefillSender`)."""

    config: LynxConfig
    # The prefill's staging memory and its transport registration (the ranges are the worker's).
    staging: StagingPool
    staging_region: Region
    # Encodes a layer's V run while the writer's thread encodes its K run (None: one thread).
    encoder: Executor | None
    # `PrefillLink.is_live` and `PrefillLink.read_aux` of SGLang's side.
    is_live: Callable[[int], bool]
    read_aux: Callable[[int], bytes]
    faults: FaultPlan

    def start(self, job: Job, pool: KVPoolView, layer: int, anchor_out, residual_out,
              spec: CodecSpec | None = None) -> PendingLayer:
        """Start encoding one layer of the job's slots with `spec` (None: the configured codec;
        else the room's, of the Anchor width picked for it) into the buffers
        (`encode_layer_start`): they hold the layer once its `finish` has returned (a device
        pool's copies run meanwhile)."""
        # Under the job's lock: the slots may be swapped for the prefix cache's between layers
        # (`PrefillSender._reconcile_streamed`), never during one (the encode has read the pool
        # rows when it returns, `fused.encode_run_start`).
        with job.lock:
            rows, index = job.rows_of(pool, layer)
            return encode_layer_start(rows, layer, index, spec or self.config.codec,
                                      self.config.chunk_tokens, job.room, anchor_out,
                                      residual_out, self.encoder)

    def await_handover(self, job: Job) -> None:
        """Layer-streamed: SGLang's hand-over of the room after its forward."""
        job.await_handover(self.is_live, self.config.transfer_timeout_s)


class StagedLayer:
    """At most one encoded layer not yet written to the transport, and how to write it: on a CUDA
    pool a layer's device-to-host copies run while the next layer is encoded, so a writer stages
    each layer (`put`) and writes it once the next one is started (`RoomWriter`'s overlap; a CPU
    pool's layer is written at once). The writer owns the staging bytes; the room's staging
    range may be given back only once `flush` or `drain` has returned."""

    def __init__(self, timeout_s: float):
        self._timeout_s = timeout_s
        self._held: tuple[PendingLayer, Callable[[], None]] | None = None

    def put(self, pending: PendingLayer, write: Callable[[], None]) -> None:
        """Stage a layer just started (`write` posts it once `pending` has finished): the layer
        staged before it is written first, and a layer already in staging at once."""
        try:
            self.flush()
        except BaseException:
            pending.settle(self._timeout_s)  # not staged yet: `drain` would miss it
            raise
        self._held = (pending, write)
        if not pending.copying:
            self.flush()

    def flush(self) -> None:
        """Write the staged layer, if any (its `finish` waits for its copies; a failure there
        waits for all of them, `PendingLayer.finish`)."""
        if self._held is not None:
            (_, write), self._held = self._held, None
            write()

    def drain(self) -> None:
        """On a failure: wait for the staged layer's copies without writing it, so that no byte
        lands in the room's staging range once the worker has given it back."""
        if self._held is not None:
            (pending, _), self._held = self._held, None
            pending.settle(self._timeout_s)


def layer_written(pending: PendingLayer, plan: StreamPlan, timeout_s: float) -> int:
    """Once an encoded layer's bytes are in staging: its Residual bytes, after checking that its
    Anchor has the plan's exact size."""
    written, r_written = pending.finish(timeout_s)
    if written != plan.anchor_layer_bytes:
        raise KVStreamError(f"layer {pending.layer}: encoded {written} B of Anchor, "
                            f"expected {plan.anchor_layer_bytes} B")
    return r_written


class RoomWriter:
    """Writes one room's two streams to one decode from its staging range, layer by layer
    (`layer`, in order), then ends the Anchor (`finish_anchor`) and the Residual
    (`finish_residual`). Split in steps so that a destination worker can interleave the rooms of
    one forward (`DestinationWorker.send_group`): layer by layer, every Anchor ended before any
    Residual.

    Each layer is encoded straight into staging and its Anchor written at once. After the
    forward, every layer's Anchor (and the aux) goes before any Residual byte: an int8 Residual
    is cheap and of fixed size, so it is encoded in the same pass, at its place; an exact
    Residual costs ~10x its Anchor, so it is encoded in a second pass, after the whole Anchor is
    out, each layer written as soon as it is placed. Layer-streamed (during the forward, as soon
    as the forward has written the layer), each layer's Residual is encoded in the Anchor's pass
    and written with it."""

    def __init__(self, deps: WriterDeps, session: Session, job: Job, pool: KVPoolView,
                 staging: StagingRange, plan: StreamPlan):
        self.deps, self.session, self.job, self.pool = deps, session, job, pool
        self.staging, self.plan = staging, plan
        config = deps.config
        # The room's Anchor width (`backend.prefill.anchor_width`) is the plan's.
        self.spec = config.codec_for(plan.anchor_bits)
        self.residual_base = staging.offset + plan.anchor_bytes
        # Layer-streamed, the Residual goes out with its layer too: the forward of the later
        # layers leaves the time (and the link idle between Anchor layers), and the transport
        # still sends the Anchor first. Not while a fault plan holds the Residual back.
        self.stream_residual = (config.residual and job.gate is not None
                                and not deps.faults.holds(Point.RESIDUAL))
        self.one_pass = config.residual and (config.codec.target is Target.INT8
                                             or self.stream_residual)
        job.trace.facts.update(one_pass=self.one_pass, residual_streamed=self.stream_residual)
        self.residual_at = 0  # stream offset of the next Residual layer (streamed or second pass)
        self.posted = 0  # bytes of both streams, once `finish_residual` has run
        self._staged = StagedLayer(config.transfer_timeout_s)
        job.trace.mark("encode_start")

    def run(self) -> int:
        for layer in range(self.plan.num_layers):
            self.layer(layer)
        self.finish_anchor()
        return self.finish_residual()

    def layer(self, layer: int) -> None:
        try:
            self._layer(layer)
        except BaseException:
            self._staged.drain()
            raise

    def _layer(self, layer: int) -> None:
        deps, job, plan = self.deps, self.job, self.plan
        buf = deps.staging.buffer
        if job.gate is not None:
            if job.gate.opened <= layer:
                self._staged.flush()  # nothing held back while the forward computes the layer
            job.gate.wait(layer, deps.config.transfer_timeout_s)
            # An aborted request's slots are freed right after its forward, and may be written
            # by the next one: stop reading them.
            if not deps.is_live(job.room):
                raise RoomDroppedError("SGLang dropped the room during its forward")
        t0 = time.time()
        at = self.staging.offset + plan.anchor_offset(layer)
        r_at = self.residual_base + layer * plan.residual_layer_bytes
        pending = deps.start(
            job, self.pool, layer, buf[at: at + plan.anchor_layer_bytes],
            buf[r_at: r_at + plan.residual_layer_bytes] if self.one_pass else None, self.spec)
        # the previous layer's copies ran during this encode
        self._staged.put(pending, functools.partial(self._post, pending, at, r_at, t0))

    def _post(self, pending: PendingLayer, at: int, r_at: int, t0: float) -> None:
        """Write a layer to the transport once its bytes are in staging."""
        deps, job, plan, room = self.deps, self.job, self.plan, self.job.room
        layer = pending.layer
        r_written = layer_written(pending, plan, deps.config.transfer_timeout_s)
        self.session.write_stream(room, Stream.ANCHOR, deps.staging_region, at,
                                  plan.anchor_layer_bytes, stream_offset=plan.anchor_offset(layer))
        if self.stream_residual:
            self._post_residual(r_at, r_written)
        job.trace.span("encode_anchor", layer, t0, time.time())
        if layer + 1 == plan.num_layers // 2:
            deps.faults.hold(Point.ANCHOR_MID, room, (layer + 1, plan.num_layers))

    def _post_residual(self, r_at: int, n: int) -> None:
        """Write one layer's Residual (`n` bytes at staging offset `r_at`) next on the stream: an
        exact layer is as long as its values need, so the layers go back to back on the stream,
        each from its own (bound-sized) place in staging."""
        self.session.write_stream(self.job.room, Stream.RESIDUAL, self.deps.staging_region, r_at,
                                  n, stream_offset=self.residual_at)
        self.residual_at += n

    def finish_anchor(self) -> None:
        """After every layer: the Anchor's end, with the aux (layer-streamed: once SGLang has
        handed the room over after the forward)."""
        deps, job = self.deps, self.job
        self._staged.flush()
        if job.gate is not None:
            job.trace.mark("anchor_layers_posted")
            deps.await_handover(job)
        self.session.finish(job.room, Stream.ANCHOR, aux=deps.read_aux(job.aux_index))
        job.trace.mark("anchor_posted")

    def finish_residual(self) -> int:
        """After `finish_anchor`: the rest of the Residual and its end. Returns the bytes
        posted, both streams."""
        deps, session, job, plan = self.deps, self.session, self.job, self.plan
        room, tr, config, region = job.room, job.trace, deps.config, deps.staging_region
        deps.faults.hold(Point.RESIDUAL, room)
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
            stream_at = self._second_pass()
        session.finish(room, Stream.RESIDUAL)
        tr.mark("residual_posted")
        tr.mark("encode_end")
        self.posted = plan.anchor_bytes + stream_at
        return self.posted

    def _second_pass(self) -> int:
        """The exact Residual after the whole Anchor is out: the Anchor encoded again (the
        corrections are relative to it) into scratch, each layer's Residual into its own
        bound-sized place in staging and written as soon as it is in, the layers back to back on
        the stream, each as long as its values need. On a CUDA pool layer l is written once
        layer l + 1 is encoded (`RoomWriter`'s overlap). Returns the stream's bytes."""
        deps, job, plan = self.deps, self.job, self.plan
        buf, timeout = deps.staging.buffer, deps.config.transfer_timeout_s
        scratch = np.empty(plan.anchor_layer_bytes, dtype=np.uint8)
        staged = StagedLayer(timeout)

        def write(pending: PendingLayer, r_at: int, t0: float) -> None:
            _, written = pending.finish(timeout)
            self._post_residual(r_at, written)
            job.trace.span("encode_residual", pending.layer, t0, time.time())

        try:
            for layer in range(plan.num_layers):
                t0 = time.time()
                r_at = self.residual_base + layer * plan.residual_layer_bytes
                pending = deps.start(job, self.pool, layer, scratch,
                                     buf[r_at: r_at + plan.residual_layer_bytes], self.spec)
                staged.put(pending, functools.partial(write, pending, r_at, t0))
            staged.flush()
        except BaseException:
            staged.drain()
            raise
        return self.residual_at


class WindowedWriter:
    """Writes a windowed room (`backend.window`; the decode announced it in segments): segment
    after segment, once the decode has announced it, each encoded into its own prefill staging
    range, both streams written and finished, the range handed to the worker's staging
    (`inflight`) to reap. The decode announces a segment only when a window is free, so this
    waits for it (bounded by the transfer timeout). Sent after the forward: `layer` does nothing,
    everything happens in `finish_residual`, so in a layer-streamed group the room waits for the
    others' Anchors."""

    def __init__(self, deps: WriterDeps, session: Session, job: Job, pool: KVPoolView,
                 plan: StreamPlan, segments: Segments, inflight: InFlightStaging):
        self.deps, self.session, self.job, self.pool = deps, session, job, pool
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
            self.deps.await_handover(self.job)  # every layer is in the pool after it

    def finish_residual(self) -> int:
        deps, session, job, seg = self.deps, self.session, self.job, self.segments
        tr = job.trace
        tr.mark("encode_start")
        for j in range(seg.count):
            request_id = seg.request_id(job.room, j)
            plan = seg.plan(self.plan, j)
            ann = self._wait_announcement(request_id, j)
            check_announcement(ann, plan)
            staging = self.inflight.allocate(plan.staging_bytes)
            last = j + 1 == seg.count
            try:
                posted = self._segment(request_id, plan, seg.layers(j), staging, last)
            except BaseException:
                release_request(session, request_id)
                deps.staging.free(staging)
                raise
            self.inflight.add(InFlight(request_id, session, staging, tr if last else None))
            self.posted += posted
            if j == 0 and not last:
                deps.faults.hold(Point.RESIDUAL, job.room)  # between the first segment and the next
        tr.mark("encode_end")
        return self.posted

    def _wait_announcement(self, request_id: int, j: int):
        """Segment j's announcement, within the transfer timeout; a room SGLang dropped
        meanwhile (the decode aborted it) stops at once instead of holding this worker."""
        deps, room = self.deps, self.job.room
        timeout = deps.config.transfer_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            if not deps.is_live(room):
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
        """Encode and write one segment from `staging`; returns its bytes, both streams. Each
        layer's Residual goes into its own bound-sized place, so that on a CUDA pool a layer's
        copies run while the next one is encoded (`StagedLayer`, as `RoomWriter`); the layers
        go back to back on the Residual stream, after the segment's Anchor."""
        deps, session, job = self.deps, self.session, self.job
        buf, region, residual = deps.staging.buffer, deps.staging_region, deps.config.residual
        residual_at = staging.offset + plan.anchor_bytes
        placed: list[tuple[int, int]] = []  # each layer's Residual: (staging offset, bytes)

        def landed(pending: PendingLayer, r_at: int, t0: float) -> None:
            placed.append((r_at, layer_written(pending, plan, deps.config.transfer_timeout_s)))
            job.trace.span("encode_anchor", pending.layer, t0, time.time())

        staged = StagedLayer(deps.config.transfer_timeout_s)
        try:
            for i, layer in enumerate(layers):
                t0 = time.time()
                at = staging.offset + plan.anchor_offset(i)
                r_at = residual_at + i * plan.residual_layer_bytes
                pending = deps.start(
                    job, self.pool, layer, buf[at: at + plan.anchor_layer_bytes],
                    buf[r_at: r_at + plan.residual_layer_bytes] if residual else None)
                staged.put(pending, functools.partial(landed, pending, r_at, t0))
            staged.flush()
        except BaseException:
            staged.drain()
            raise
        session.write_stream(request_id, Stream.ANCHOR, region, staging.offset, plan.anchor_bytes,
                             stream_offset=0)
        session.finish(request_id, Stream.ANCHOR,
                       aux=deps.read_aux(job.aux_index) if last else b"")
        if last:
            job.trace.mark("anchor_posted")
        r_len = 0
        if residual:
            for r_at, n in placed:
                session.write_stream(request_id, Stream.RESIDUAL, region, r_at, n,
                                     stream_offset=r_len)
                r_len += n
            session.finish(request_id, Stream.RESIDUAL)
            if last:
                job.trace.mark("residual_posted")
        return plan.anchor_bytes + r_len


def check_announcement(ann, plan: StreamPlan) -> None:
    """The decode announced the stream extents this prefill plans for `plan`."""
    for ws, stream in _STREAMS.items():
        if ann.stream_nbytes(stream) != plan.stream_extent(ws):
            raise SettingsMismatchError(
                f"decode announced {ann.stream_nbytes(stream)} B for the {ws.name} "
                f"stream, this prefill plans {plan.stream_extent(ws)} B: the --lynx-* "
                "flags or the model differ between prefill and decode")
