"""The life of one request's transfer on the decode side (`DecodeRoom`), as an explicit state
machine: `RoomState` plus one method per transition. Every transition checks where it comes from
and logs at debug level.

    AWAITING_SESSION --announced--> ANNOUNCED
    ANNOUNCED --anchor_applied--> ANCHOR_APPLIED                (SGLang not told yet)
    ANNOUNCED --anchor_applied(reported)--> SPECULATING         (Success reported at Anchor time)
    ANCHOR_APPLIED --final_kv--> AWAITING_PREFILL               (Residual in the pool)
    ANNOUNCED --final_kv--> AWAITING_PREFILL                    (Anchor and Residual landed together,
                                                                  or the Anchor-only baseline)
    AWAITING_PREFILL --done--> DONE                             (the prefill's Success arrived too)
    SPECULATING --refined--> REFINED                            (the speculation controller verifies)
    any live state --fail--> FAILED;  --cancel--> CANCELLED

The prefill's own Success status may arrive in any state (`prefill_success` remembers it). Owned
by `backend.decode.DecodeApplier`, always under its lock; the room's record is plain data.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import torch

from lynx_transport import Session

from .outcome import ResidualOutcome, ResidualState
from .plan import StreamPlan
from .staging import StagingRange

logger = logging.getLogger(__name__)


class RoomState(enum.Enum):
    AWAITING_SESSION = "awaiting_session"
    ANNOUNCED = "announced"
    ANCHOR_APPLIED = "anchor_applied"
    SPECULATING = "speculating"
    AWAITING_PREFILL = "awaiting_prefill"
    REFINED = "refined"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# States in which the applier still has work (bytes may land, a stream may complete).
TRANSFERRING = frozenset({RoomState.AWAITING_SESSION, RoomState.ANNOUNCED,
                          RoomState.ANCHOR_APPLIED, RoomState.SPECULATING})
TERMINAL = frozenset({RoomState.DONE, RoomState.REFINED, RoomState.FAILED, RoomState.CANCELLED})


class RoomStateError(RuntimeError):
    """A transition from a state it does not start from: a bug, never a peer's doing."""


@dataclass
class DecodeRoom:
    room: int
    prefill: tuple[str, int]
    slots: torch.Tensor
    aux_index: int
    plan: StreamPlan
    staging: StagingRange | None
    state: RoomState = RoomState.AWAITING_SESSION
    created: float = field(default_factory=time.monotonic)
    session: Session | None = None
    # Parsed Anchor chunks, kept from the Anchor's apply until the Residual's.
    anchors: dict | None = None
    prefill_success: bool = False
    reported_at_anchor: bool = False
    failure: str | None = None
    # time.monotonic() (system-wide on Linux, so comparable with the transport's timestamps)
    t_anchor_landed: float | None = None
    t_anchor_applied: float | None = None
    t_residual_landed: float | None = None
    t_residual_applied: float | None = None

    # ---- transitions --------------------------------------------------------------------------
    def _move(self, allowed: frozenset[RoomState] | set[RoomState], to: RoomState,
              why: str) -> None:
        if self.state not in allowed:
            raise RoomStateError(f"room {self.room}: {why} in state {self.state.value}")
        logger.debug("lynx room %s: %s -> %s (%s)", self.room, self.state.value, to.value, why)
        self.state = to

    def announced(self, session: Session) -> None:
        self._move({RoomState.AWAITING_SESSION}, RoomState.ANNOUNCED, "staging announced")
        self.session = session

    def anchor_applied(self, t_landed: float, *, reported: bool) -> None:
        """The Anchor is in the pool; `reported`: Success went to SGLang now (speculation)."""
        self._move({RoomState.ANNOUNCED},
                   RoomState.SPECULATING if reported else RoomState.ANCHOR_APPLIED,
                   "Anchor applied" + (", Success reported" if reported else ""))
        self.t_anchor_landed = t_landed
        self.reported_at_anchor = reported

    def final_kv(self, t_anchor_landed: float | None, t_residual_landed: float | None) -> None:
        """The final KV (Residual-refined, or the Anchor alone as the lossy baseline) is in the
        pool and SGLang was not told at Anchor time."""
        self._move({RoomState.ANNOUNCED, RoomState.ANCHOR_APPLIED}, RoomState.AWAITING_PREFILL,
                   "final KV in the pool")
        if self.t_anchor_landed is None:
            self.t_anchor_landed = t_anchor_landed
        self._residual_in(t_residual_landed)

    def refined(self, t_residual_landed: float) -> None:
        """Speculating room: the Residual refined the pool; the controller verifies now."""
        self._move({RoomState.SPECULATING}, RoomState.REFINED, "Residual applied")
        self._residual_in(t_residual_landed)

    def _residual_in(self, t_landed: float | None) -> None:
        self.t_residual_landed = t_landed
        self.t_residual_applied = time.monotonic()
        self.anchors = None

    def done(self) -> None:
        self._move({RoomState.AWAITING_PREFILL}, RoomState.DONE, "Success reported")

    def fail(self, reason: str) -> None:
        self._move(TRANSFERRING | {RoomState.AWAITING_PREFILL}, RoomState.FAILED, reason)
        self.failure = reason
        self.anchors = None

    def cancel(self) -> None:
        self._move(TRANSFERRING | {RoomState.AWAITING_PREFILL}, RoomState.CANCELLED,
                   "released before it completed")
        self.anchors = None

    # ---- views --------------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self.state not in TERMINAL

    def outcome(self) -> ResidualOutcome:
        """The speculation controller's view of a room reported at Anchor time."""
        if self.state is RoomState.FAILED:
            state = ResidualState.FAILED
        elif self.state is RoomState.REFINED:
            state = ResidualState.APPLIED
        else:
            state = ResidualState.PENDING
        return ResidualOutcome(state, self.failure or "", self.t_anchor_landed,
                               self.t_residual_applied)
