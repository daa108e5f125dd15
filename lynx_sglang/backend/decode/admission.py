"""Admission of decode rooms (`StagingAdmission`): each room's staging range, taken at `register`
or, for a room that finds none free, from the staging queue; its announcement to its prefill rank's
session; and both given back (`release`).

`register` (SGLang's scheduler thread, from the receiver's `send_metadata`) never waits: a room
that finds no free range (or others queued before it) is queued, first come first served, and its
receiver holds its metadata back until `staged` says the room got a range (so the prefill does not
start it meanwhile); past the waiting budget it fails. A room larger than the whole staging pool
is windowed (`backend.window`): it holds one or two windows, which its segments of whole layers
take in turns (`announce_segment`, from `backend.decode.windowed`); only a room one layer of
which exceeds the pool fails at once.

Driven by `backend.decode.applier.DecodeApplier` (SGLang's calls, and `admit_queued` from the applier
thread). Buffer ownership: a room's staging range is the applier's from its allocation here until
`release`, which first withdraws the room's announcements (no byte lands after it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from lynx_transport import Region, Session, Stream, TransportError

from ...config import LynxConfig
from ...errors import RoomDroppedError, StagingFullError
from ...names import STAGING_QUEUED_LOG, WINDOWED_ROOM_LOG
from ...recorder import Recorder
from ..plan import StreamPlan, room_plans, windowed_plan
from ..pool import KVPoolView
from ..staging import ALIGN as STAGING_ALIGN
from ..staging import StagingPool
from ..window import SEGMENT_IDS, Windows
from ..window import choose as choose_windows
from ..window import cut as cut_segments
from .room import DecodeRoom, RoomState, Source
from .rooms import RoomTable
from .sessions import PrefillSessions

logger = logging.getLogger(__name__)


class StagingAdmission:
    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, sessions: PrefillSessions, rooms: RoomTable,
                 recorder: Recorder, wake: Callable[[], None], waiting_s: float):
        self.config = config
        self.recorder = recorder  # the record of a room that waited for staging in vain
        self._pool = pool
        self.staging = staging
        self.staging_region = staging_region
        self.sessions = sessions
        self.rooms = rooms
        self._wake = wake  # the applier thread: a room was announced, or a range came free
        # How long a room may wait for a staging range, then for its prefill's session, and its
        # transfer may take from its announcement (see `DecodeApplier`).
        self.waiting_s = waiting_s
        # Rooms that found no staging range, in arrival order (ids of rooms dropped meanwhile are
        # skipped when they come up).
        self._queue: deque[int | tuple[int, int]] = deque()  # `DecodeRoom.key`s
        self._next_segment_id = SEGMENT_IDS.start  # ids of windowed rooms' segments 1..

    # ---- SGLang's scheduler thread ------------------------------------------------------------
    def register(self, room_id: int, sources: list[Source], kv_indices, aux_index: int,
                 rid: str | None = None) -> bool:
        """See `DecodeApplier.register`. A room of several sources is one `DecodeRoom` per source
        (`DecodeRoom.part`), each with a plan of its heads and its own staging range; their
        ranges are queued one after the other, and the room is staged once all are."""
        pool = self._pool()
        slots = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64), device=pool.device)
        planned = []
        for source in sources:
            shape = (pool if source.heads is None else pool.heads(*source.heads)).shape
            plans = room_plans(self.config, shape, len(slots))
            plan = plans[self.config.codec.anchor_bits]
            windows = None
            if not self.staging.holds(plan.staging_bytes):
                if len(sources) > 1:
                    raise StagingFullError(
                        f"room {room_id} takes KV from {len(sources)} prefill ranks and one "
                        f"rank's part needs {plan.staging_bytes} B of staging, more than the "
                        f"whole pool ({self.staging.nbytes} B); such a room is not sent in "
                        "segments: raise --lynx-staging-mib")
                plan = windowed_plan(self.config, shape, len(slots))
                plans = {plan.anchor_bits: plan}
                windows = choose_windows(plan, self.staging.nbytes, STAGING_ALIGN)
            planned.append((source, plans, windows))
        staged = True
        with self.rooms.lock:
            self.admit_queued()
            for part, (source, plans, windows) in enumerate(planned):
                staged &= self._add(room_id, source, slots, aux_index, plans, windows, rid,
                                    part, len(planned))
        self._wake()
        return staged

    def _add(self, room_id: int, source: Source, slots: torch.Tensor, aux_index: int,
             plans: dict[int, StreamPlan], windows: Windows | None, rid: str | None, part: int,
             parts: int) -> bool:
        """With the table's lock held: hold one new room (one part of a room of several
        sources), with a staging range if one is free and no room is queued before it (never
        block the scheduler thread; never overtake), announced if its session is up; else queued.
        True if it got a range."""
        plan = plans[self.config.codec.anchor_bits]
        need = windows.staging_bytes if windows else plan.staging_bytes
        staging = None if self._queue else self.staging.try_allocate(need)
        segments = None
        if windows is not None:
            segments = cut_segments(plan.num_layers, windows.layers_per_segment,
                                    self._next_segment_id)
            self._next_segment_id += segments.count - 1
        room = DecodeRoom(room_id, source.prefill, slots, aux_index, plan, staging, windows,
                          segments, part=part, parts=parts, heads=source.heads, plans=plans)
        if rid is not None:
            room.trace.facts["rid"] = rid
        if parts > 1:
            room.trace.facts.update(part=part, parts=parts, heads=list(source.heads))
        if windows is not None:
            room.trace.facts.update(segments=segments.count, windows=windows.count)
            logger.info("lynx: room %s needs %d B of staging, " + WINDOWED_ROOM_LOG +
                        " (%d B): sent in %d segments of %d layers through %d windows of %d B",
                        room_id, plan.staging_bytes, self.staging.nbytes, segments.count,
                        windows.layers_per_segment, windows.count, windows.nbytes)
        self.rooms.add(room)
        if staging is None:
            self._queue.append(room.key)
            logger.info("lynx: room %s %s: needs %d B (%d B free, %d rooms queued before "
                        "it)", room_id, STAGING_QUEUED_LOG, need,
                        self.staging.free_bytes(), len(self._queue) - 1)
            return False
        self.try_announce(room)
        return True

    def staged(self, room_id: int) -> bool:
        """See `DecodeApplier.staged`: True once every part of the room holds its range."""
        with self.rooms.lock:
            self.admit_queued()
            parts = self.rooms.parts_of(room_id)
            if not parts:
                raise RoomDroppedError(f"room {room_id} was dropped while it waited for staging")
            waiting = [r for r in parts if r.state is RoomState.AWAITING_STAGING]
            if not waiting:
                return True
            if time.monotonic() - min(r.waiting_since for r in waiting) <= self.waiting_s:
                return False
            need = sum(r.staging_need for r in waiting)
            reason = (f"no {need} B of staging came free within "
                      f"{self.waiting_s:g} s ({self.staging.free_bytes()} B free of "
                      f"{self.staging.nbytes} B; raise --lynx-staging-mib, or admit fewer "
                      "concurrent requests)")
            for room in parts:
                self.rooms.pop(room.key)
                self.rooms.wait_idle(room)  # a part that got its range may be being applied
                room.fail(reason)
                self.release(room)
        for room in parts:
            self.recorder.emit(room.trace)
        raise StagingFullError(reason)

    # ---- with the room table's lock held ------------------------------------------------------
    def admit_queued(self) -> int:
        """Give the queued rooms, oldest first, the ranges that are free now and announce them;
        stops at the first that does not fit (no overtaking, so a long request is never starved
        by short ones). Returns how many got one."""
        admitted = 0
        while self._queue:
            room = self.rooms.get(self._queue[0])  # a DecodeRoom.key
            if room is None or room.state is not RoomState.AWAITING_STAGING:
                self._queue.popleft()  # dropped or failed while queued
                continue
            staging = self.staging.try_allocate(room.staging_need)
            if staging is None:
                break
            self._queue.popleft()
            room.staged(staging)
            logger.info("lynx: room %s got its staging after %.0f ms in the queue", room.room,
                        room.trace.facts["staging_wait_ms"])
            self.try_announce(room)
            admitted += 1
        if admitted:
            self._wake()
        return admitted

    def try_announce(self, room: DecodeRoom) -> bool:
        """Announce the room (a windowed room: a segment per window) if its prefill rank's
        session is up. True if it was."""
        s = self.sessions.get(room.prefill)
        if s is None or s.closed:
            return False
        if room.segments is None:
            # The applier and the speculation controller say when the room waits on its
            # Residual (`Session.mark_waiting`); a windowed room's segments do not.
            self._announce(s, room.room, room.plan, room.staging.offset, signals_waiting=True)
        else:
            for _ in range(min(room.windows.count, room.segments.count)):
                self.announce_segment(s, room)
        room.announced(s)
        return True

    # ---- the applier thread (and `try_announce`) ----------------------------------------------
    def announce_segment(self, s: Session, room: DecodeRoom) -> None:
        """Announce the room's next segment into its window (segment j takes window j mod the
        window count, which segment j - count has left)."""
        seg, j = room.segments, room.progress.seg_announced
        at = room.staging.offset + (j % room.windows.count) * room.windows.nbytes
        self._announce(s, seg.request_id(room.room, j), seg.plan(room.plan, j), at,
                       seg.meta() if j == 0 else b"")
        room.progress.segment_announced()

    def _announce(self, s: Session, request_id: int, plan: StreamPlan, at: int,
                  meta: bytes = b"", signals_waiting: bool = False) -> None:
        """Both streams' extents of `plan` (any width the prefill may pick fits), back to back
        from staging offset `at`; `signals_waiting`: this side tells the prefill when it waits
        on the Residual."""
        rid = self.staging_region.id
        s.announce(request_id, {
            Stream.ANCHOR: [(rid, at, plan.anchor_extent)],
            Stream.RESIDUAL: [(rid, at + plan.anchor_extent, plan.residual_extent)]},
            deadline_s=self.waiting_s, stall_deadline_s=self.config.transfer_timeout_s,
            meta=meta, signals_waiting=signals_waiting)

    def release_request(self, room: DecodeRoom, request_id: int) -> None:
        """Withdraw one of the room's announcements (the room's, or one segment's): no byte of it
        lands after this returns."""
        try:
            room.session.release(request_id)
        except TransportError as exc:
            logger.debug("lynx: release of room %s (request %s): %s", room.room, request_id, exc)

    def release(self, room: DecodeRoom) -> None:
        """Withdraw the room's announcements (no byte lands after this) and free its staging
        range (the oldest queued room may take it). With or without the table's lock."""
        if room.session is not None:
            for request_id in room.segment_ids():
                self.release_request(room, request_id)
            room.session = None
        room.progress.drop_views()
        if room.staging is not None:
            self.staging.free(room.staging)
            room.staging = None
            if self._queue:
                self._wake()  # the applier gives the range to the oldest queued room
