"""Aborts a decode sent for rooms this prefill does not know yet (`EarlyAborts`).

A decode that refuses a request as its receiver is created (a settings mismatch, unequal TP)
tells the prefill ranks at once; with the prefill's bootstrap info already cached, that abort can
reach a prefill rank before the request itself does. SGLang's prefill drops an abort for a room
it does not know, so the request then sat in Bootstrapping until SGLang's bootstrap timeout
(300 s by default). The prefill's `LynxKVManager` remembers such aborts here, for a bounded time
and number, and fails the room as soon as SGLang opens it.

Owned by a prefill `backend.manager.LynxKVManager`: `note` runs on SGLang's bootstrap thread,
`take` on the scheduler's (opening a room); one lock covers both and the manager's own check of
whether the room is known, so an abort is either seen by the open room or remembered for it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class EarlyAborts:
    """Rooms aborted before they were opened, kept `ttl_s` seconds, at most `cap` of them (the
    oldest forgotten first: a peer cannot make this grow)."""

    def __init__(self, ttl_s: float, cap: int):
        self.ttl_s = ttl_s
        self.cap = cap
        self.lock = threading.Lock()
        self._rooms: OrderedDict[int, float] = OrderedDict()

    def note(self, room: int) -> None:
        """Remember an abort for `room` (call with `lock` held, after finding it unknown)."""
        self._expire()
        self._rooms[room] = time.monotonic()
        self._rooms.move_to_end(room)
        while len(self._rooms) > self.cap:
            self._rooms.popitem(last=False)

    def take(self, room: int) -> bool:
        """Whether `room` was aborted before it was opened (and forget it); call with `lock`."""
        self._expire()
        return self._rooms.pop(room, None) is not None

    def __len__(self) -> int:
        return len(self._rooms)

    def _expire(self) -> None:
        oldest_kept = time.monotonic() - self.ttl_s
        while self._rooms and next(iter(self._rooms.values())) < oldest_kept:
            self._rooms.popitem(last=False)
