"""Every decode room not yet forgotten, by room id (`RoomTable`): transferring, awaiting the
prefill's Success, reported at Anchor time and not yet consumed by the speculation controller, or
failed and its Failed not yet reported; and which of them the applier thread is working on.

Created by `backend.decode.DecodeApplier` and shared with the parts it drives
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
        self._rooms: dict[int, DecodeRoom] = {}
        # Rooms the applier thread is working on (cancel/drop wait for them to leave).
        self._applying: set[DecodeRoom] = set()

    def get(self, room_id: int) -> DecodeRoom | None:
        """One dict read, safe without `lock`; whoever acts on the room holds it."""
        return self._rooms.get(room_id)

    def add(self, room: DecodeRoom) -> None:
        """With `lock` held."""
        self._rooms[room.room] = room

    def pop(self, room_id: int) -> DecodeRoom | None:
        """With `lock` held: forget the room."""
        return self._rooms.pop(room_id, None)

    def forget(self, room: DecodeRoom) -> None:
        """With `lock` held: forget `room` unless another room took its id meanwhile (or it is
        forgotten already: its receiver dropped it)."""
        if self._rooms.get(room.room) is room:
            del self._rooms[room.room]

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
