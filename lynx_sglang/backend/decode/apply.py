"""Applying an announced decode room's two streams into the KV pool as they land
(`StreamApplier`; a windowed room's segments are `backend.decode.windowed`'s).

Each step works on what has landed so far. Each Anchor layer is validated as soon as its bytes are
in; when speculation is on (or there is no Residual) it is also dequantized into the room's KV
slots right away. Each Residual layer is validated and written at full precision as soon as its
chunks are in. With `--lynx-apply-threads 2` a layer's V run is applied on a helper thread
(`apply_helper`) while this thread applies its K run; the layer's call returns only when both have
ended. When the whole Anchor is in, SGLang's aux data (the first token) is written and the room
decides whether speculating pays (`backend.decode.policy`): speculating, Success is reported now
and SGLang decodes on the Anchor; otherwise SGLang hears Success only once every layer is final
(and the prefill's own Success arrived), so nothing in SGLang sees Anchor-precision KV.

Called by `DecodeApplier.run` on the applier thread, for a room it marked applying; reads the
room's staging range, which stays allocated until the room is concluded or failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from lynx_kernels import CodecSpec
from lynx_kernels.wire import HEADER
from lynx_transport import Stream, StreamState

from ...config import LynxConfig
from ...errors import KVStreamError
from ..aux import unpack_aux
from ..pool import KVPoolView
from ..staging import StagingPool
from ..streams import anchor_bits_of, apply_anchor_layer, apply_full_layer
from .policy import Estimates, decide_speculation, not_speculating
from .report import DecodeLink, StatusReporter
from .room import DecodeRoom, RoomState
from .rooms import RoomTable


@dataclass(frozen=True)
class ApplyDeps:
    """What both appliers of a decode (`StreamApplier`, `backend.decode.windowed.WindowedApplier`)
    work with, built once by `backend.decode.applier.DecodeApplier`."""

    config: LynxConfig
    pool: Callable[[], KVPoolView]
    staging: StagingPool
    rooms: RoomTable
    link: DecodeLink
    reporter: StatusReporter
    # With --lynx-apply-threads 2: applies a layer's V run while the applier thread applies its K.
    apply_helper: Executor | None
    # Wakes the applier thread: look again, more may have landed.
    wake: Callable[[], None]
    # The decode's attention TP size: its ranks take every speculation decision alike.
    tp_ranks: int = 1


class StreamApplier:
    """Applies the landed streams of an announced room that is not windowed (see the module): its
    Anchor layers as they land, its Residual layers as they complete, and at Anchor time the aux
    data and the speculation decision. Holds no state of its own: a room's progress rides on its
    `DecodeRoom`, and the cost estimates it decides with are the decode applier's. Called by
    `backend.decode.applier.DecodeApplier` (`step`), on the applier thread, for a room marked applying."""

    def __init__(self, deps: ApplyDeps, estimates: Estimates):
        self.deps = deps
        # By Anchor width: the spec a room's chunks are checked and decoded with.
        self._specs = {w: deps.config.codec_for(w) for w in deps.config.anchor_widths()}
        self.estimates = estimates

    def step(self, room: DecodeRoom) -> None:
        """Apply what has landed of an announced room (not windowed) since the last step."""
        anchor = self.deps.reporter.stream_or_fail(room, Stream.ANCHOR)
        if anchor is None:
            return
        residual = None
        if self.deps.config.residual:
            residual = self.deps.reporter.stream_or_fail(room, Stream.RESIDUAL)
            if residual is None:
                return
        pool = part_pool(self.deps.pool(), room)
        progressed = self._land_anchor_layers(room, anchor)
        progressed |= self._write_final_layers(room, residual, pool)
        if room.state is RoomState.ANNOUNCED:
            progressed |= self._write_anchor_layers(room, pool)
        if room.state is RoomState.ANNOUNCED and anchor.ok:
            self._anchor_complete(room, anchor, residual, pool)
        # Every layer may be in the pool before the stream's end reaches us (on tcp the bytes
        # can overtake the completion message). Concluding releases the announcement, and a
        # prefill whose finish of the Residual came after that found no live announcement and
        # failed a request whose KV was complete (seen at 64 concurrent requests): wait for it.
        if room.progress.all_final and (residual is None or residual.ok) \
                and room.state in (RoomState.SPECULATING, RoomState.AWAITING_RESIDUAL):
            sync_pool(pool)
            if room.state is RoomState.SPECULATING:
                room.refined()
            else:
                room.final_kv()
            self.deps.reporter.conclude(room)
        if progressed:
            self.deps.wake()  # more may have landed meanwhile

    def _land_anchor_layers(self, room: DecodeRoom, st: StreamState) -> bool:
        view = self.deps.staging.view(room.staging)
        landed = landed_prefix(st, room.plan.anchor_extent)
        if room.progress.anchor_layers_landed == 0 and landed:
            room.trace.mark_mono("anchor_first_byte", st.t_first_byte)
        if not room.width_known and landed >= HEADER.size:
            room.resolve_width(anchor_bits_of(view))
        if st.ok and landed != room.plan.anchor_bytes:
            raise KVStreamError(f"the Anchor stream ended after {landed} B; the request's "
                                f"Anchor has {room.plan.anchor_bytes} B")
        return room.progress.land_anchor(view, room.plan, min(landed, room.plan.anchor_bytes))

    def _spec(self, room: DecodeRoom) -> CodecSpec:
        return self._specs[room.plan.anchor_bits]

    def _write_anchor_layers(self, room: DecodeRoom, pool: KVPoolView) -> bool:
        """Dequantize the landed Anchor layers that are not final yet into the pool."""
        if self.deps.config.residual and (not self.deps.config.speculate or room.parts > 1):
            return False  # nothing would read Anchor-precision KV before the Residual's
        wrote = False
        for layer, runs in room.progress.take_unwritten_anchor():
            t0 = time.time()
            if room.trace.marks.get("anchor_apply_start") is None:
                room.trace.mark("anchor_apply_start", t0)
            apply_anchor_layer(runs, pool, layer, room.slots, self._spec(room), room.room,
                               self.deps.apply_helper)
            t1 = time.time()
            room.trace.span("anchor_apply", layer, t0, t1)
            self.estimates.note_anchor_layer(t1 - t0)
            wrote = True
        return wrote

    def _write_final_layers(self, room: DecodeRoom, st: StreamState | None,
                            pool: KVPoolView) -> bool:
        """Write the full-precision values of every layer whose Residual is complete (and whose
        Anchor has landed)."""
        if st is None:
            return False
        progress = room.progress
        view = self.deps.staging.view(room.staging)[room.plan.anchor_extent:]
        landed = landed_prefix(st, len(view))
        if landed and "residual_first_byte" not in room.trace.marks:
            room.trace.mark_mono("residual_first_byte", st.t_first_byte)
        wrote = False
        for layer, anchor, chunks in progress.take_residual(view, landed):
            t0 = time.time()
            if room.trace.marks.get("residual_apply_start") is None:
                room.trace.mark("residual_apply_start", t0)
            apply_full_layer(anchor, chunks, pool, layer, room.slots, self._spec(room), room.room,
                             self.deps.apply_helper)
            room.trace.span("residual_apply", layer, t0, time.time())
            progress.finalized(layer)
            wrote = True
        if progress.residual_done and "residual_landed" not in room.trace.marks:
            # Every layer's bytes are in; on tcp that can be seen before the stream's completion
            # message, and the room may conclude before it: mark the landing now.
            landed_at = st.t_done if st.ok else time.monotonic()
            room.trace.mark_mono("residual_landed", landed_at)
            since_anchor = progress.residual_since_anchor
            if room.t_anchor_landed is not None and since_anchor is not None:
                self.estimates.learn_residual_rate(room.prefill, since_anchor,
                                                   landed_at - room.t_anchor_landed)
        if st.ok and progress.residual_done and progress.residual_parsed != landed:
            raise KVStreamError(f"the Residual stream has {landed - progress.residual_parsed} B "
                                "after its last layer")
        if st.ok and not progress.residual_done:
            raise KVStreamError(f"the Residual stream ended after {progress.residual_parsed} B "
                                f"with layer {progress.residual_next_layer} incomplete")
        return wrote

    def _anchor_complete(self, room: DecodeRoom, st: StreamState, residual: StreamState | None,
                         pool: KVPoolView) -> None:
        """The whole Anchor is in the pool (or validated): write SGLang's aux data and decide
        whether SGLang decodes on it now."""
        room.trace.mark_mono("anchor_landed", st.t_done)
        self.deps.link.write_aux(room.aux_index, unpack_aux(st.aux or b""))
        if not self.deps.config.residual:
            # Anchor-only baseline: the Anchor is the final KV.
            self._write_anchor_layers(room, pool)
            sync_pool(pool)
            room.trace.mark("anchor_applied")
            room.final_kv(anchor_only=True)
            self.deps.reporter.conclude(room)
            return
        room.progress.anchor_complete(residual.nbytes)
        if room.parts > 1:
            # Each part would decide alone, and SGLang must hear one Success for the room.
            decision = not_speculating(f"its KV comes from {room.parts} prefill ranks (a prefill "
                                       "attention TP size larger than the decode's)")
        else:
            decision = decide_speculation(
                self.deps.config, room.plan, st, residual,
                final_layers=room.progress.final_layers,
                anchor_written=room.progress.anchor_written, estimates=self.estimates,
                link=room.prefill, tp_ranks=self.deps.tp_ranks)
        if decision.speculating:
            self._write_anchor_layers(room, pool)
            sync_pool(pool)
            room.trace.mark("anchor_applied")
        with self.deps.rooms.lock:
            room.decide(decision)
            room.anchor_complete(st.t_done)
        if decision.speculating:
            self.deps.reporter.success_at_anchor(room)
        else:
            # SGLang waits for the Residual from now: the prefill's link order may send it
            # before newer requests' Anchors (lynx_transport.link_order, rule 6).
            room.session.mark_waiting(room.room)


def part_pool(pool: KVPoolView, room: DecodeRoom) -> KVPoolView:
    """The pool as the room's streams fill it: the KV heads of its source (a part of a room of
    several sources), else all."""
    return pool if room.heads is None else pool.heads(*room.heads)


def landed_prefix(st: StreamState, bound: int) -> int:
    """Bytes of a stream that are in: a prefix, as each stream lands in order on tcp; backends that
    cannot tell (RDMA writes) report the total once the stream is complete."""
    return min(st.nbytes, bound)


def sync_pool(pool: KVPoolView) -> None:
    """Wait for the writes queued on the pool's device (before SGLang may read the KV)."""
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
