"""Applying a windowed decode room (`WindowedApplier`; a room larger than the whole staging pool,
`backend.window`): once both streams of its oldest announced segment are complete, validate and
write that segment's layers at full precision, withdraw its announcement, and announce the next
segment into the freed window; after the last segment, conclude. A windowed room never speculates:
its whole Anchor is in only with its last segment, Residual and all.

Called by `DecodeApplier.run` on the applier thread, for a room it marked applying. A segment's
window in the room's staging range is reused by the next segment only after the segment's
announcement was withdrawn (`StagingAdmission.release_request`): no byte of it lands afterwards.
"""

from __future__ import annotations

import time

from lynx_transport import Stream, StreamState

from ...errors import KVStreamError
from ..aux import unpack_aux
from ..plan import StreamPlan
from ..pool import KVPoolView
from ..streams import ResidualReader, anchor_layer, apply_anchor_layer, apply_full_layer
from .admission import StagingAdmission
from .apply import ApplyDeps, landed_prefix, sync_pool
from .policy import not_speculating
from .room import DecodeRoom


class WindowedApplier:
    """Applies a windowed room segment by segment (see the module). Called by
    `backend.decode.applier.DecodeApplier` (`step`), on the applier thread, for a room marked applying."""

    def __init__(self, deps: ApplyDeps, admission: StagingAdmission):
        self.deps = deps
        self.spec = deps.config.codec
        # Withdraws an applied segment's announcement and announces the next into its window.
        self.admission = admission

    def step(self, room: DecodeRoom) -> None:
        """Apply the room's oldest announced segment if both its streams are complete."""
        seg, j = room.segments, room.progress.seg_applied
        request_id = seg.request_id(room.room, j)
        anchor = self.deps.reporter.stream_or_fail(room, Stream.ANCHOR, request_id)
        if anchor is None:
            return
        if j == 0 and "anchor_first_byte" not in room.trace.marks:
            room.trace.mark_mono("anchor_first_byte", anchor.t_first_byte)
        residual = None
        if self.deps.config.residual:
            residual = self.deps.reporter.stream_or_fail(room, Stream.RESIDUAL, request_id)
            if residual is None:
                return
        if not anchor.ok or (residual is not None and not residual.ok):
            return
        plan = seg.plan(room.plan, j)
        at = (j % room.windows.count) * room.windows.nbytes
        view = self.deps.staging.view(room.staging)[at: at + plan.staging_bytes]
        layers = seg.layers(j)
        pool = self.deps.pool()
        residual_bytes = self._write_segment(room, j, plan, view, residual, pool)
        room.progress.segment_written(len(layers), residual_bytes)
        if j + 1 < seg.count:
            sync_pool(pool)
            self.admission.release_request(room, request_id)
            room.progress.segment_released()
            if room.progress.seg_announced < seg.count:
                self.admission.announce_segment(room.session, room)
            self.deps.wake()  # the next segment may be in already
            return
        # The last segment (released with the room): its Anchor's end carries SGLang's aux
        # data (the first token).
        self._conclude(room, anchor, residual, pool)

    def _write_segment(self, room: DecodeRoom, j: int, plan: StreamPlan, view: memoryview,
                       residual: StreamState | None, pool: KVPoolView) -> int:
        """Validate segment `j` (its streams in `view`, laid out by its `plan`) and write its
        layers: at full precision, or the Anchor alone without a Residual. Returns the segment's
        Residual bytes."""
        layers = room.segments.layers(j)
        if residual is None:
            for i, layer in enumerate(layers):
                apply_anchor_layer(anchor_layer(view, plan, i), pool, layer, room.slots,
                                   self.spec, room.room, self.deps.apply_helper)
            return 0
        landed = landed_prefix(residual, plan.residual_bytes)
        reader = ResidualReader(len(layers), plan.num_tokens, first_layer=layers.start,
                                kinds=plan.kinds)
        ready = reader.advance(view[plan.anchor_bytes:], landed)
        if not reader.done or reader.pos != landed:
            raise KVStreamError(f"segment {j} (layers {layers.start}-{layers.stop - 1}): its "
                                f"Residual of {landed} B does not hold exactly its layers")
        if j == 0:
            room.trace.mark_mono("residual_first_byte", residual.t_first_byte)
        t0 = time.time()
        room.trace.marks.setdefault("residual_apply_start", t0)
        for layer, chunks in ready:
            apply_full_layer(anchor_layer(view, plan, layer - layers.start), chunks, pool,
                             layer, room.slots, self.spec, room.room, self.deps.apply_helper)
        room.trace.span("residual_apply", layers.start, t0, time.time())
        return reader.pos

    def _conclude(self, room: DecodeRoom, anchor: StreamState, residual: StreamState | None,
                  pool: KVPoolView) -> None:
        """Every segment is final in the pool: write SGLang's aux data and conclude."""
        sync_pool(pool)
        room.trace.mark_mono("anchor_landed", anchor.t_done)
        if residual is not None:
            room.trace.mark_mono("residual_landed", residual.t_done)
        self.deps.link.write_aux(room.aux_index, unpack_aux(anchor.aux or b""))
        decision = not_speculating(
            f"windowed: {room.segments.count} segments through {room.windows.count} windows")
        with self.deps.rooms.lock:
            room.decide(decision)
            if residual is not None:
                room.anchor_complete(anchor.t_done)
        if residual is None:
            room.trace.mark("anchor_applied")
            room.final_kv(anchor_only=True)
        else:
            room.final_kv()
        self.deps.reporter.conclude(room)
