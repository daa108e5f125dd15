"""The life of one request's transfer on the decode side (`DecodeRoom`), as an explicit state
machine: `RoomState` plus one method per transition. Every transition checks where it comes from
and logs at debug level.

    AWAITING_STAGING --staged--> AWAITING_SESSION              (a staging range came free; only
                                                                a room that found none at register)
    AWAITING_SESSION --announced--> ANNOUNCED                  (bytes land; layers are applied)
    ANNOUNCED --anchor_complete--> AWAITING_RESIDUAL           (decided not to speculate)
    ANNOUNCED --anchor_complete--> SPECULATING                 (decided to: Success reported now)
    ANNOUNCED | AWAITING_RESIDUAL --final_kv--> AWAITING_PREFILL   (every layer final, or the
                                                                  Anchor-only baseline)
    AWAITING_PREFILL --done--> DONE                            (the prefill's Success arrived too)
    SPECULATING --refined--> REFINED                           (the speculation controller verifies)
    any live state --fail--> FAILED;  --cancel--> CANCELLED

Beside its state a room holds what does not follow from it: the prefill's own Success status,
which may arrive in any state (`prefill_success`), its speculation decision, made once
(`decide`; `backend.decode.policy`), which says after a failure too whether SGLang heard Success
at Anchor time, and how far its bytes have come (`progress`, a `TransferProgress`).

A room whose KV comes from several prefill ranks is one DecodeRoom per source (`part` of `parts`,
`Source`), each its own state machine over its own stream pair; the table and the reporter join
them (`RoomTable.parts_of`, `StatusReporter`).

Owned by `backend.decode.applier.DecodeApplier` and the parts it drives: rooms are kept in its
`RoomTable`; a transition that SGLang's threads may meet (staged, announced, anchor_complete, done,
fail, cancel) happens under that table's lock, and the progress belongs to the applier thread
while it works on the room (`RoomTable.start_applying`).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import torch

from lynx_transport import Session

from ... import trace as tracing
from ...errors import KVStreamError
from ..plan import StreamPlan
from ..staging import StagingRange
from ..window import Segments, Windows
from .outcome import ResidualOutcome, ResidualState
from .policy import UNDECIDED, SpeculationDecision
from .progress import TransferProgress

logger = logging.getLogger(__name__)


class RoomState(enum.Enum):
    AWAITING_STAGING = "awaiting_staging"
    AWAITING_SESSION = "awaiting_session"
    ANNOUNCED = "announced"
    AWAITING_RESIDUAL = "awaiting_residual"
    SPECULATING = "speculating"
    AWAITING_PREFILL = "awaiting_prefill"
    REFINED = "refined"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


# States in which the applier still has work (bytes may land, a stream may complete).
TRANSFERRING = frozenset({RoomState.AWAITING_SESSION, RoomState.ANNOUNCED,
                          RoomState.AWAITING_RESIDUAL, RoomState.SPECULATING})
TERMINAL = frozenset({RoomState.DONE, RoomState.REFINED, RoomState.FAILED, RoomState.CANCELLED})
# States a room may fail or be cancelled from.
ENDABLE = TRANSFERRING | {RoomState.AWAITING_STAGING, RoomState.AWAITING_PREFILL}


class RoomStateError(RuntimeError):
    """A transition from a state it does not start from: a bug, never a peer's doing."""


@dataclass(frozen=True)
class Source:
    """One prefill rank a decode room's KV comes from, and the KV heads (first, count) of the
    decode's pool its stream fills (None: every head, the room's only source)."""

    prefill: tuple[str, int]
    heads: tuple[int, int] | None = None


# Compared by identity: two rooms are never the same because their fields are equal.
@dataclass(eq=False)
class DecodeRoom:
    # SGLang's room id: also the transport request id and the codec's request tag of its streams.
    room: int
    prefill: tuple[str, int]
    slots: torch.Tensor
    aux_index: int
    plan: StreamPlan
    staging: StagingRange | None
    # A windowed room (`backend.window`; larger than the whole staging pool): its windows and
    # segments.
    windows: Windows | None = None
    segments: Segments | None = None
    # A room whose KV comes from several prefill ranks (a prefill attention TP size larger than
    # the decode's; `backend.heads.source_slices`) is one DecodeRoom per source, each with its own
    # session, staging and progress: `part` of `parts`, writing KV heads `heads` (first, count)
    # of the pool. One source: part 0 of 1, every head.
    part: int = 0
    parts: int = 1
    heads: tuple[int, int] | None = None
    # The plan of each Anchor width the prefill may pick (`backend.plan.room_plans`; one: the
    # room's plan). `plan` is the configured width's until the first Anchor chunk names the
    # width picked (`resolve_width`).
    plans: dict[int, StreamPlan] = field(default_factory=dict)
    state: RoomState = RoomState.AWAITING_SESSION
    created: float = field(default_factory=time.monotonic)
    # Since when the room waits for what it needs next (a staging range, then the prefill's
    # session): the waiting budget counts from here, not from `created`.
    waiting_since: float = field(default_factory=time.monotonic)
    session: Session | None = None
    prefill_success: bool = False
    failure: str | None = None
    decision: SpeculationDecision = UNDECIDED
    t_anchor_landed: float | None = None
    t_residual_applied: float | None = None
    trace: tracing.Trace = field(init=False)
    progress: TransferProgress = field(init=False)

    def __post_init__(self) -> None:
        self.plans = self.plans or {self.plan.anchor_bits: self.plan}
        if self.staging is None:
            self.state = RoomState.AWAITING_STAGING
        self.waiting_since = self.created
        self.progress = TransferProgress(self.plan.num_layers, self.plan.num_tokens,
                                         windowed=self.segments is not None,
                                         kinds=self.plan.kinds)
        self.trace = tracing.Trace("decode", self.room)
        self.trace.mark_mono("registered", self.created)
        self.trace.facts.update(tokens=self.plan.num_tokens, anchor_bits=self.plan.anchor_bits,
                                anchor_bytes=self.plan.anchor_bytes)

    @property
    def width_known(self) -> bool:
        """Whether `plan` is the Anchor width the prefill sends (one allowed, or resolved)."""
        return len(self.plans) == 1

    def resolve_width(self, anchor_bits: int) -> None:
        """The first Anchor chunk says the prefill picked `anchor_bits` (the applier thread,
        before any Anchor layer is parsed): that width's plan is the room's from now on.
        KVStreamError for a width the decode did not allow."""
        plan = self.plans.get(anchor_bits)
        if plan is None:
            raise KVStreamError(f"the Anchor's first chunk has {anchor_bits} Anchor bits; this "
                                f"decode takes {sorted(self.plans)} (--lynx-anchor-bits, "
                                "--lynx-anchor-width)")
        self.plan, self.plans = plan, {anchor_bits: plan}
        self.trace.facts.update(anchor_bits=anchor_bits, anchor_bytes=plan.anchor_bytes)

    # ---- transitions --------------------------------------------------------------------------
    def _move(self, allowed: frozenset[RoomState] | set[RoomState], to: RoomState,
              why: str) -> None:
        if self.state not in allowed:
            raise RoomStateError(f"room {self.room}: {why} in state {self.state.value}")
        logger.debug("lynx room %s: %s -> %s (%s)", self.room, self.state.value, to.value, why)
        self.state = to

    def staged(self, staging: StagingRange) -> None:
        self._move({RoomState.AWAITING_STAGING}, RoomState.AWAITING_SESSION, "staging allocated")
        self.staging = staging
        self.waiting_since = time.monotonic()
        self.trace.mark("staged")
        self.trace.facts["staging_wait_ms"] = round((self.waiting_since - self.created) * 1e3, 3)

    def announced(self, session: Session) -> None:
        self._move({RoomState.AWAITING_SESSION}, RoomState.ANNOUNCED, "staging announced")
        self.session = session
        self.trace.mark("announced")

    def decide(self, decision: SpeculationDecision) -> None:
        """Record the speculation decision, made once (not a transition: a windowed Anchor-only
        room decides and then goes on as the baseline does)."""
        if self.decision.decided or not decision.decided:
            raise RoomStateError(f"room {self.room}: speculation decided "
                                 f"{self.decision.mode.value}, then {decision.mode.value}")
        self.decision = decision
        self.trace.facts.update(decision.trace_facts())

    def anchor_complete(self, t_landed: float | None) -> None:
        """The whole Anchor is in, and the room has decided: speculating, Success goes to SGLang
        now."""
        if not self.decision.decided:
            raise RoomStateError(f"room {self.room}: Anchor complete, speculation undecided")
        reported = self.decision.speculating
        self._move({RoomState.ANNOUNCED},
                   RoomState.SPECULATING if reported else RoomState.AWAITING_RESIDUAL,
                   "Anchor complete" + (", Success reported" if reported else ""))
        self.t_anchor_landed = t_landed

    def final_kv(self, *, anchor_only: bool = False) -> None:
        """The final KV (every layer Residual-refined, or the Anchor alone as the lossy baseline)
        is in the pool and SGLang was not told at Anchor time."""
        self._move({RoomState.ANNOUNCED} if anchor_only else {RoomState.AWAITING_RESIDUAL},
                   RoomState.AWAITING_PREFILL, "final KV in the pool")
        self.t_residual_applied = time.monotonic()

    def refined(self) -> None:
        """Speculating room: the Residual refined the pool; the controller verifies now."""
        self._move({RoomState.SPECULATING}, RoomState.REFINED, "Residual applied")
        self.t_residual_applied = time.monotonic()

    def done(self) -> None:
        self._move({RoomState.AWAITING_PREFILL}, RoomState.DONE, "Success reported")
        self.trace.mark("reported")

    def fail(self, reason: str) -> None:
        self._move(ENDABLE, RoomState.FAILED, reason)
        self.failure = reason
        self.trace.facts["failure"] = reason

    def cancel(self) -> None:
        self._move(ENDABLE, RoomState.CANCELLED,
                   "released before it completed")
        self.trace.facts["cancelled"] = True

    # ---- views --------------------------------------------------------------------------------
    @property
    def key(self) -> int | tuple[int, int]:
        """The room's key in the decode's `RoomTable`: SGLang's room id, or (room id, part) for a
        part of a room with several sources."""
        return self.room if self.parts == 1 else (self.room, self.part)

    @property
    def staging_need(self) -> int:
        """Bytes of staging the room holds: its windows, or its whole plan."""
        return self.windows.staging_bytes if self.windows else self.plan.staging_bytes

    def segment_ids(self) -> list[int]:
        """Transport request ids announced for the room and not yet released."""
        if self.segments is None:
            return [self.room]
        return [self.segments.request_id(self.room, j)
                for j in range(self.progress.seg_applied, self.progress.seg_announced)]

    @property
    def live(self) -> bool:
        return self.state not in TERMINAL

    @property
    def reported_at_anchor(self) -> bool:
        """Success goes to SGLang at Anchor time: the room decided to speculate (whatever its
        state is now)."""
        return self.decision.speculating

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
