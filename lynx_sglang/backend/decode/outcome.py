"""What became of a request's Residual: the contract between the decode applier
(`backend.decode.applier.DecodeApplier.residual_outcome`, which produces it) and the speculation controller
(`speculation.controller.SpecController`, which acts on it). No SGLang imports, so the controller's
pure parts can be tested without a server."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ResidualState(Enum):
    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"


@dataclass(frozen=True)
class ResidualOutcome:
    """What the speculation controller needs to know about a room reported at Anchor time.
    Times are time.monotonic() (None until the event happened)."""

    state: ResidualState
    reason: str = ""
    t_anchor_landed: float | None = None
    t_residual_applied: float | None = None
