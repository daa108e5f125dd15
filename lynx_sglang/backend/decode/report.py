"""How a decode room's end reaches SGLang (`StatusReporter`), through the manager's `DecodeLink`:
Success at Anchor time (a speculating room), or once the final KV is in the pool and the prefill's
own Success arrived (`conclude`, `on_prefill_success`); Failed, in an order SGLang cannot get
wrong (`fail`); and each transfer's record (log line and metrics).

Driven by `backend.decode.applier.DecodeApplier` and its appliers (`backend.decode.apply`,
`backend.decode.windowed`): `conclude` and `fail` from the applier thread, `on_prefill_success`
from SGLang's. A room reported at Anchor time stays in the table for the speculation controller;
any other room is forgotten once SGLang has its status.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from lynx_transport import FailureReason, Status, Stream, StreamState

from ...config import LynxConfig
from ...failures import FailureKind, stream_failure_kind
from ...names import TRANSFER_RECORD, record_line
from ...recorder import Recorder
from .bindings import BootstrapSlot, Registration
from .room import DecodeRoom, RoomState
from .rooms import RoomTable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeLink:
    """What the applier needs from SGLang's side of the manager (all thread-safe callables)."""

    # The one status report: (room, None for Success | the failure reason).
    report: Callable[[int, str | None], None]
    # Write SGLang's aux items [(buffer index, bytes)] into the room's aux slot `aux_index`.
    write_aux: Callable[[int, list[tuple[int, bytes]]], None]
    # A prefill rank (ip, port) died or never connected: forget SGLang's cached route to it.
    forget_prefill_rank: Callable[[tuple[str, int]], None]
    # A room reported at Anchor time reached its outcome (Residual applied, or failed): the
    # speculation controller has something to read, so wake a scheduler waiting in its idle path.
    progress: Callable[[], None]
    # Ask SGLang's bootstrap server again what it lists at a slot, within a timeout (s); raises
    # when it does not answer (`backend.decode.bindings`).
    lookup_prefill_rank: Callable[[BootstrapSlot, float], Registration]


class StatusReporter:
    def __init__(self, config: LynxConfig, rooms: RoomTable, link: DecodeLink, recorder: Recorder,
                 release: Callable[[DecodeRoom], None], wake: Callable[[], None]):
        self.config = config
        self.rooms = rooms
        self.link = link
        self.recorder = recorder
        self._release = release  # gives back the room's announcements and staging range
        self._wake = wake  # the applier thread

    # ---- the applier thread -------------------------------------------------------------------
    def success_at_anchor(self, room: DecodeRoom) -> None:
        """A speculating room: SGLang decodes on its Anchor from now on."""
        self.link.report(room.room, None)
        room.trace.mark("reported")

    def conclude(self, room: DecodeRoom) -> None:
        """The room's KV is final in the pool: record it, give back the transfer resources, and
        report Success unless that happened at Anchor time (or waits for the prefill's)."""
        room.trace.mark("residual_applied" if self.config.residual else "anchor_applied")
        self._record(room)
        self._release(room)
        report = False
        with self.rooms.lock:
            if room.state is RoomState.AWAITING_PREFILL and room.prefill_success:
                room.done()
                self.rooms.pop(room.key)
                # A room of several sources: SGLang hears Success with its last part.
                report = not self.rooms.parts_of(room.room)
        if room.state is RoomState.REFINED or report:
            self.recorder.emit(room.trace)
        if report:
            self.link.report(room.room, None)
        elif room.reported_at_anchor:
            self.link.progress()

    def stream_or_fail(self, room: DecodeRoom, stream: Stream,
                       request_id: int | None = None) -> StreamState | None:
        """The stream's receive state (of the room, or of one of its segments), or None after
        failing the room because the stream failed."""
        st = room.session.recv_state(room.room if request_id is None else request_id, stream)
        if st.status is Status.FAILED:
            name = "Anchor" if stream is Stream.ANCHOR else "Residual"
            if st.reason is FailureReason.PEER_DIED:
                self.link.forget_prefill_rank(room.prefill)
            self.fail(room, f"{name} stream failed: {st.reason.value} {st.detail}",
                      stream_failure_kind(st.reason))
            return None
        return st

    def fail_safely(self, room: DecodeRoom, reason: str, kind: FailureKind) -> None:
        """`fail` from the applier's catch-all: whatever goes wrong there too is logged, and the
        thread that serves every other request goes on."""
        try:
            if room.live:
                self.fail(room, reason, kind)
        except Exception:
            logger.exception("lynx: failing room %s failed", room.room)

    def fail(self, room: DecodeRoom, reason: str, kind: FailureKind) -> None:
        """Fail the room (from the applier thread); with it the other parts of a room of several
        sources, whose transfers then stop (their prefill ranks find no announcement)."""
        logger.error("lynx: room %s failed (%s): %s", room.room, kind.value, reason)
        self.recorder.metrics.record_failure(kind)
        with self.rooms.lock:
            room.fail(reason)
            reported = room.reported_at_anchor
            others = [r for r in self.rooms.parts_of(room.room) if r is not room and r.live]
            for other in others:
                other.fail(f"part {room.part + 1} of {room.parts} of the room failed: {reason}")
        for failed in (room, *others):
            self._release(failed)
            self.recorder.emit(failed.trace)
        if reported:
            # SGLang already has Success and no longer polls: the speculation controller aborts
            # the running request when it reads this outcome.
            self.link.progress()
            return
        # Failed reaches SGLang before the room is forgotten: until then a prefill Success finds
        # the failed room and is held back (`on_prefill_success`), afterwards it finds SGLang's
        # Failed, which SGLang never lets a later Success replace. Forgotten first, a Success in
        # between reached SGLang first and its receiver's poll kept it (issue 42: 1 room in 60).
        try:
            self.link.report(room.room, reason)
        finally:
            with self.rooms.lock:
                for failed in (room, *others):
                    self.rooms.forget(failed)

    # ---- SGLang's thread (status from the prefill) --------------------------------------------
    def on_prefill_success(self, room_id: int) -> bool:
        """See `DecodeApplier.on_prefill_success`."""
        with self.rooms.lock:
            parts = self.rooms.parts_of(room_id)
            if not parts:
                return False
            for room in parts:
                room.prefill_success = True
                if room.state is RoomState.AWAITING_PREFILL:
                    room.done()
                    self.rooms.pop(room.key)
                    self.recorder.emit(room.trace)
            if not self.rooms.parts_of(room_id):
                return False  # every part's final KV is in
            self._wake()
            return True

    # ---- the record ---------------------------------------------------------------------------
    def _record(self, room: DecodeRoom) -> None:
        plan = room.plan
        residual_bytes = room.progress.residual_bytes if self.config.residual else 0
        room.trace.facts["residual_bytes"] = residual_bytes
        marks = room.trace.marks

        def ms(start: str, end: str) -> float | None:
            if marks.get(start) is None or marks.get(end) is None:
                return None
            return round((marks[end] - marks[start]) * 1e3, 3)

        logger.info("%s", record_line(TRANSFER_RECORD, {
            "room": room.room, "rid": room.trace.facts.get("rid"), "tokens": plan.num_tokens,
            "anchor_bits": plan.anchor_bits, "anchor_bytes": plan.anchor_bytes,
            "residual_bytes": residual_bytes,
            "announced": marks.get("announced"), "anchor_landed": marks.get("anchor_landed"),
            "anchor_applied": marks.get("anchor_applied"),
            "residual_landed": marks.get("residual_landed"),
            "residual_applied": marks.get("residual_applied"),
            "speculate": room.trace.facts.get("speculate"),
            # Durations: the Anchor's and the Residual's time on the wire (first byte to last),
            # applying each after it landed, and the whole transfer from the announcement.
            "anchor_wire_ms": ms("anchor_first_byte", "anchor_landed"),
            "anchor_apply_ms": ms("anchor_landed", "anchor_applied"),
            "residual_wire_ms": ms("residual_first_byte", "residual_landed"),
            "residual_apply_ms": ms("residual_landed", "residual_applied"),
            "total_ms": ms("announced", "residual_applied" if self.config.residual
                           else "anchor_applied")}))
        anchor_applied = marks.get("anchor_applied")
        anchor_landed = marks.get("anchor_landed")
        self.recorder.metrics.record_transfer(
            plan.anchor_bytes, residual_bytes,
            None if anchor_applied is None else anchor_applied - marks["registered"],
            None if anchor_landed is None or not self.config.residual
            else marks["residual_applied"] - anchor_landed, plan.anchor_bits)
