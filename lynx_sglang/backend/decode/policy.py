"""Whether a decode room speculates (SGLang decodes on its Anchor before the Residual is in): the
running costs the decision weighs (`Estimates`), the decision a room records once
(`SpeculationDecision`), and the decision itself (`decide_speculation`, a pure function of one
room's transfer so far).

Called by `backend.decode.apply.StreamApplier` when a room's whole Anchor is in; a windowed room
(`backend.decode.windowed`) never speculates and records `not_speculating`. `Estimates` is fed by
the applying (each Anchor layer's write, each Residual's arrival) and by the speculation controller
(each verification, through `DecodeApplier.note_verification`); it is used by the applier thread
only, but for `note_verification` (a float assignment).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lynx_transport import StreamState

from ...config import LynxConfig
from ..plan import StreamPlan

# What one verification is assumed to cost before the first one was measured (a GPU's order of
# magnitude; on a CPU the first measurement replaces it).
INITIAL_VERIFY_ESTIMATE_S = 0.05
# Residuals shorter than this say little about the rate of long ones (see `learn_residual_rate`).
LEARN_RESIDUAL_RATE_MIN_BYTES = 1 << 20
# Prefill ranks whose Residual rate is remembered; past it the one heard from longest ago is
# forgotten (a deployment has a handful; the cap keeps a churning fleet from growing the map).
MAX_RESIDUAL_LINKS = 256

# A prefill rank's bootstrap (host, port): the link a room's streams cross (`DecodeRoom.prefill`).
Link = tuple[str, int]


class Estimates:
    """Running costs the speculation decision weighs (exponential moving averages)."""

    def __init__(self, verify_s: float):
        self.verify_s = verify_s
        self.anchor_layer_s: float | None = None
        # Per prefill rank, bytes/s at which its earlier Residuals came in after their Anchor was
        # complete. The Anchor's own rate underestimates the Residual's arrival when the prefill
        # codes the Residual slower than it sends (the exact target: measured 610 ms to land
        # where the Anchor's rate predicted 181 ms). Per rank, since prefills differ in link and
        # load: one decode serves several. Insertion-ordered: the least recently heard first.
        self._residual_rates: dict[Link, float] = {}

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new

    def note_anchor_layer(self, seconds: float) -> None:
        """One Anchor layer took `seconds` to write into the pool."""
        self.anchor_layer_s = self._ema(self.anchor_layer_s, seconds)

    def note_verification(self, seconds: float) -> None:
        """One verification took `seconds` (the speculation controller measured it)."""
        self.verify_s = self._ema(self.verify_s, seconds)

    def residual_rate(self, link: Link) -> float | None:
        """The rate `link`'s recent Residuals came in at (None: none long enough yet)."""
        return self._residual_rates.get(link)

    def learn_residual_rate(self, link: Link, nbytes: int, seconds: float) -> None:
        """A Residual's `nbytes` from the prefill rank at `link` landed `seconds` after its
        Anchor was complete. Small ones are not learned from: their time is the fixed cost of a
        request (a 5-token warm-up's Residual would set the rate of the long prompt after it)."""
        if nbytes < LEARN_RESIDUAL_RATE_MIN_BYTES or seconds <= 0:
            return
        rate = self._ema(self._residual_rates.pop(link, None), nbytes / seconds)
        self._residual_rates[link] = rate
        if len(self._residual_rates) > MAX_RESIDUAL_LINKS:
            del self._residual_rates[next(iter(self._residual_rates))]

    def residual_eta(self, link: Link, remaining: int, anchor_rate: float) -> tuple[float, str]:
        """Seconds until `remaining` Residual bytes from `link` are in, and what rate said so:
        the slower of that link's recent Residuals' rate and this request's Anchor's. The
        Residual follows this Anchor on the same link, so it comes no faster than the Anchor
        did, while the link's recent Residuals may have crossed it before it slowed (seen at
        R = 16 after a warm-up at 1 Gbit/s: the learned rate, an average that forgets slowly,
        put Residuals 23-41 s away at 0.1-0.6 s, and one request waited 23 s for its Residual
        instead of speculating). Another prefill's Residuals say nothing of this link. The error
        costs are lopsided too: waiting wrongly loses the Residual's wire time, speculating
        wrongly one verification."""
        rate = self._residual_rates.get(link)
        if rate is not None and rate <= anchor_rate:
            return remaining / rate, "at this prefill's recent Residuals' rate"
        return remaining / anchor_rate, "at this Anchor's rate"


class Speculation(enum.Enum):
    # The room's whole Anchor is not in yet; an Anchor-only room (the lossy baseline) never leaves
    # it: its Anchor is its final KV.
    UNDECIDED = "undecided"
    # Success was reported at Anchor time: SGLang decodes on the Anchor, and the room stays with
    # the applier until the speculation controller has read its Residual outcome.
    SPECULATING = "speculating"
    # SGLang hears Success only once every layer is final.
    NOT_SPECULATING = "not_speculating"


@dataclass(frozen=True)
class SpeculationDecision:
    """A room's speculation decision, and why; with the estimate it weighed when it weighed one."""

    mode: Speculation
    why: str = ""
    residual_eta_s: float | None = None  # seconds until the Residual was expected in
    cost_s: float | None = None  # what speculating costs before it can pay back

    @property
    def speculating(self) -> bool:
        return self.mode is Speculation.SPECULATING

    @property
    def decided(self) -> bool:
        return self.mode is not Speculation.UNDECIDED

    def trace_facts(self) -> dict[str, object]:
        """What the room's trace records of the decision (`lynx_sglang.trace`)."""
        facts: dict[str, object] = {}
        if self.residual_eta_s is not None and self.cost_s is not None:
            facts.update(residual_eta_s=round(self.residual_eta_s, 6),
                         speculation_cost_s=round(self.cost_s, 6))
        facts.update(speculate=self.speculating, why=self.why)
        return facts


UNDECIDED = SpeculationDecision(Speculation.UNDECIDED)


def speculating(why: str, **estimate: float) -> SpeculationDecision:
    return SpeculationDecision(Speculation.SPECULATING, why, **estimate)


def not_speculating(why: str, **estimate: float) -> SpeculationDecision:
    return SpeculationDecision(Speculation.NOT_SPECULATING, why, **estimate)


def decide_speculation(config: LynxConfig, plan: StreamPlan, anchor: StreamState,
                       residual: StreamState | None, *, final_layers: int, anchor_written: int,
                       estimates: Estimates, link: Link, tp_ranks: int = 1
                       ) -> SpeculationDecision:
    """Whether decoding on the complete Anchor now beats waiting for the Residual: the Residual's
    expected arrival (its bytes still to come, at the rate the recent Residuals of the prefill
    at `link` came in, else at the rate this Anchor came in) against what speculating costs
    first (the Anchor layers still to write into the pool, one verification).
    `final_layers`/`anchor_written`: the room's layers at full precision / with their Anchor in
    the pool so far.

    With `tp_ranks` > 1 (the decode's attention TP size) every rank decides the same from the
    flags alone: each rank's streams land at their own times, and a request one rank speculates
    on while another waits would have the ranks run different batches (seen: a TP 2 decode hung
    on a request its rank 1 speculated on and its rank 0 did not)."""
    if not config.speculate:
        return not_speculating("--no-lynx-speculate")
    if tp_ranks > 1:
        return speculating(f"decode attention TP {tp_ranks}: every rank speculates alike")
    if final_layers == plan.num_layers or (residual is not None and residual.ok):
        return not_speculating("the Residual is already in")
    if config.spec_policy == "always":
        return speculating("--lynx-spec-policy always")
    if anchor.t_first_byte is None or anchor.t_done is None:
        return speculating("no rate measured")
    seconds = max(anchor.t_done - anchor.t_first_byte, 1e-6)
    remaining = max(plan.residual_bytes_expected - residual.nbytes, 0)
    eta, basis = estimates.residual_eta(link, remaining, plan.anchor_bytes / seconds)
    layers_left = plan.num_layers - max(anchor_written, final_layers)
    cost = layers_left * (estimates.anchor_layer_s or 0.0) + estimates.verify_s
    if eta <= cost:
        return not_speculating(f"the Residual is due in {eta * 1e3:.0f} ms ({basis}), sooner than "
                               f"speculating would pay back ({cost * 1e3:.0f} ms)",
                               residual_eta_s=eta, cost_s=cost)
    return speculating(f"the Residual is due in {eta * 1e3:.0f} ms ({basis})",
                       residual_eta_s=eta, cost_s=cost)
