"""The prefill's fault-injection seam (tests only; `lynx-sglang faults` and the in-process tests):
a `FaultPlan` the prefill's room writers ask at named points of a room's transfer (`hold`), so a
fault can hit a room whose Anchor is half landed, or whose Residual has not started.

Built by `backend.manager.LynxKVManager` from the environment (`FaultPlan.from_env`) and injected
into the `PrefillSender`, which hands it to its room writers and ends every hold at shutdown
(`release`). The default plan holds nothing. The hold's log lines (`names.FAULT_*_HOLD_LOG`) are
what the fault-matrix tool waits for.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from dataclasses import dataclass, field

from ...names import (
    FAULT_ANCHOR_DELAY_ENV,
    FAULT_ANCHOR_HOLD_LOG,
    FAULT_RESIDUAL_DELAY_ENV,
    FAULT_RESIDUAL_HOLD_LOG,
)

logger = logging.getLogger(__name__)


class Point(enum.Enum):
    """Where in a room's transfer a plan may hold it."""

    # After the first half of the room's Anchor layers are on the wire.
    ANCHOR_MID = "anchor-mid"
    # After the room's Anchor, before its Residual (a windowed room: after its first segment).
    RESIDUAL = "residual"


@dataclass(frozen=True)
class FaultPlan:
    """How long to hold a room at each `Point`, in s (0, the default, is off). A hold ends early
    once `release` is called: by in-process tests, which then need no timing margin, and at
    shutdown. Thread-safe: every destination worker asks the one plan."""

    anchor_s: float = 0.0
    residual_s: float = 0.0
    _released: threading.Event = field(default_factory=threading.Event, compare=False,
                                       repr=False)

    @classmethod
    def from_env(cls) -> FaultPlan:
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

    def holds(self, point: Point) -> bool:
        """Whether rooms are held at `point` (a writer that would stream past it does not)."""
        return bool(self._seconds(point))

    def hold(self, point: Point, room: int, layers: tuple[int, int] | None = None) -> None:
        """Hold `room` at `point` for the plan's time, or until `release`; at `ANCHOR_MID`,
        `layers` is (layers written, of the room's layers), for the log line."""
        seconds = self._seconds(point)
        if not seconds:
            return
        if point is Point.ANCHOR_MID:
            logger.warning("lynx: room %s %s after %d of %d layers for %.1f s (test fault "
                           "injection)", room, FAULT_ANCHOR_HOLD_LOG, *layers, seconds)
        else:
            logger.warning("lynx: room %s %s %.1f s (test fault injection)", room,
                           FAULT_RESIDUAL_HOLD_LOG, seconds)
        self._released.wait(seconds)

    def release(self) -> None:
        """End every hold now and from now on."""
        self._released.set()

    def _seconds(self, point: Point) -> float:
        return self.anchor_s if point is Point.ANCHOR_MID else self.residual_s
