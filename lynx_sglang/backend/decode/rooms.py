"""Every decode room not yet forgotten, by room id (`RoomTable`): transferring, awaiting the
prefill's Success, reported at Anchor time and not yet consumed by the speculation controller, or
failed and its Failed not yet reported; and which of them the applier thread is working on.

Created by `backend.decode.applier.DecodeApplier` and shared with the parts it drives
(`StagingAdmission`, `StatusReporter`, the appliers). Locking: `lock` guards the rooms, the state
transitions SGLang's threads may meet, and the applying set; it is never held while bytes are
applied. Methods say whether they expect it held.
"""

from __future__ import annotations

import logging
import threading

from .room import TRANSFERRING, DecodeRoom, RoomState

logger = logging.getLogger(__name__)

# How long cancel/drop wait for a room's in-progress apply before giving up loudly (an apply is
# bounded work: one step over already-landed bytes).
BUSY_WAIT_S = 30.0


class RoomTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        # By `DecodeRoom.key`: SGLang's room id, or (room id, part) for the parts of a room with
        # several sources (`parts_of`).
        self._rooms: dict[int | tuple[int, int], DecodeRoom] = {}
        self._parts: dict[int, int] = {}  # room id -> its part count, for rooms of several
        # Rooms the applier thread is working on (cancel/drop wait for them to leave).
        self._applying: set[DecodeRoom] = set()

    def get(self, key: int | tuple[int, int]) -> DecodeRoom | None:
        """One dict read, safe without `lock`; whoever acts on the room holds it. `key`: a
        `DecodeRoom.key` (for a room of one source, SGLang's room id)."""
        return self._rooms.get(key)

    def parts_of(self, room_id: int) -> list[DecodeRoom]:
        """With `lock` held: the rooms held for SGLang's room `room_id`: the one, or the parts
        of a room with several sources still held."""
        n = self._parts.get(room_id)
        if n is None:
            room = self._rooms.get(room_id)
            return [] if room is None else [room]
        return [r for r in (self._rooms.get((room_id, p)) for p in range(n)) if r is not None]

    def add(self, room: DecodeRoom) -> None:
        """With `lock` held."""
        self._rooms[room.key] = room
        if room.parts > 1:
            self._parts[room.room] = room.parts

    def pop(self, key: int | tuple[int, int]) -> DecodeRoom | None:
        """With `lock` held: forget the room."""
        room = self._rooms.pop(key, None)
        if room is not None:
            self._forget_parts(room.room)
        return room

    def forget(self, room: DecodeRoom) -> None:
        """With `lock` held: forget `room` unless another room took its key meanwhile (or it is
        forgotten already: its receiver dropped it)."""
        if self._rooms.get(room.key) is room:
            del self._rooms[room.key]
            self._forget_parts(room.room)

    def _forget_parts(self, room_id: int) -> None:
        n = self._parts.get(room_id)
        if n is not None and not any((room_id, p) in self._rooms for p in range(n)):
            del self._parts[room_id]

    # ---- the applier thread's work ------------------------------------------------------------
    def start_applying(self) -> list[DecodeRoom]:
        """With `lock` held: the rooms the applier still has work on, marked as being applied
        until `done_applying`."""
        rooms = [r for r in self._rooms.values() if r.state in TRANSFERRING]
        self._applying.update(rooms)
        return rooms

    def done_applying(self, room: DecodeRoom) -> None:
        """With `lock` held."""
        self._applying.discard(room)
        self._idle.notify_all()

    def wait_idle(self, room: DecodeRoom) -> None:
        """With `lock` held: wait until the applier is not working on `room` (never on another
        room), at most `BUSY_WAIT_S`."""
        if not self._idle.wait_for(lambda: room not in self._applying, timeout=BUSY_WAIT_S):
            logger.error("lynx: room %s still being applied after %g s; releasing it anyway",
                         room.room, BUSY_WAIT_S)

    # ---- views --------------------------------------------------------------------------------
    def tracked(self) -> dict[str, int]:
        """Without `lock` held: the rooms held (0 on an idle decode; `lynx_tracked_requests`):
        all, those queued for staging, and those whose Anchor has part landed (`lynx-sglang
        faults` reads this one to know that its fault hits a request mid-Anchor)."""
        with self.lock:
            rooms = list(self._rooms.values())
        return {"decode_rooms": len(rooms),
                "decode_rooms_awaiting_staging": sum(
                    r.state is RoomState.AWAITING_STAGING for r in rooms),
                "decode_rooms_anchor_landing": sum(
                    r.state is RoomState.ANNOUNCED
                    and 0 < r.progress.anchor_layers_landed < r.plan.num_layers for r in rooms)}
