"""The event-by-event simulation of a deployment whose servers share a few processors (this
box: 2 cores, `Deployment.cpu`): the same stations as `model.simulate_dedicated` (each prefill a FIFO
server, one link with Anchors preempting Residuals, the decode's steps, drafts and verifications)
where every CPU activity runs at the speed the scheduler leaves its server (`SharedCpu.rates`),
recomputed at every event.

The activities, by server: the prefill's forward, its Lynx encode after the forward (a codec
thread) and, for mooncake, its transfer engine, which polls a core while its BF16 bytes are on
the wire; the decode's stepping (one activity while any request steps, drafts or verifies) and
its apply of a Residual (a codec thread). Work is counted in seconds at full speed: a forward's
is `dep.forward` (the forward with the cores it asks for), a step's `decode_step_s`. The decode's
progress is kept as a `DecodeClock`, from which each request's token times follow.

A speculative request drafts from its Anchor's arrival; when its Residual is in and applied, it
speculated if that took longer than one verification (else its first token waited for the
Residual, as `model.simulate_dedicated` decides), kept whole drafts, verifies, and steps what was not kept.
With ample cores (every rate 1) this is `model.simulate_dedicated` (tests/test_plan.py checks it).

Called by `predict.simulate` for a deployment with `cpu` set (`tools.plan.validate`'s this-box
runs); pure Python.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .model import (
    Arrival,
    DecodeClock,
    Deployment,
    RequestResult,
    Variant,
    _apply_s,
    _encode_s,
    _streams,
    _verify_s,
    decode_step_s,
)

# Seconds of work (or of wire) below which an activity counts as done: float rounding only.
_EPS = 1e-9


@dataclass
class _Work:
    """A CPU activity of a role's server: `kind` forward / codec / decode, `left` seconds at
    full speed."""

    role: str
    kind: str
    left: float
    done: Callable[[], None]


@dataclass
class _Stream:
    """One of a request's streams on the link (first: BF16 KV or Anchor; second: Residual)."""

    request: _Request
    first: bool
    left: float  # seconds of wire
    sent: bool = False  # its last byte crossed (a layer-streamed one may wait for its forward)


@dataclass
class _Request:
    arrival: Arrival
    streams: bool
    start: float = math.nan
    forward_end: float = math.nan
    first_done: float = math.nan
    pending: list[_Stream] = field(default_factory=list)  # streams not yet done
    drafting: _Work | None = None
    draft_cap: float = 0.0  # seconds of drafts it may step before stopping
    result: RequestResult | None = None


class _Box:
    """One simulation: the clock, the CPU activities, the link, the timers."""

    def __init__(self, dep: Deployment, variant: Variant, rng: random.Random):
        assert dep.cpu is not None
        self.dep, self.variant, self.rng, self.cpu = dep, variant, rng, dep.cpu
        self.step = decode_step_s(dep)
        self.t = 0.0
        self.works: list[_Work] = []
        self.link: list[tuple[int, float, int, _Stream]] = []  # (priority, release, seq, stream)
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.queues = [deque() for _ in range(dep.prefills_per_decode)]
        self.busy = [False] * dep.prefills_per_decode
        self.clock = DecodeClock()

    # --- the engine -------------------------------------------------------------------------

    def _rates(self) -> dict[str, float]:
        d = self.cpu.demand
        asked = {"prefill": 0.0, "decode": 0.0}
        stepping = False
        for w in self.works:
            if w.kind == "decode":
                stepping = True
            else:
                asked[w.role] += d.forward if w.kind == "forward" else d.codec
        if stepping:
            asked["decode"] += d.decode
        if self.link and not self.variant.lynx:
            asked["prefill"] += d.bf16_sender
        return self.cpu.rates(asked)

    def run(self) -> None:
        while self.works or self.link or self.timers:
            rates = self._rates()
            dt = math.inf
            if self.timers:
                dt = self.timers[0][0] - self.t
            if self.link:
                dt = min(dt, self.link[0][3].left)
            for w in self.works:
                dt = min(dt, w.left / rates[w.role])
            dt = max(dt, 0.0)
            for w in self.works:
                w.left -= rates[w.role] * dt
            if self.link:
                self.link[0][3].left -= dt
            self.t += dt
            self.clock.advance(self.t, rates["decode"])
            for w in [w for w in self.works if w.left <= _EPS]:
                self.works.remove(w)
                w.done()
            while self.link and self.link[0][3].left <= _EPS:
                self._sent(heapq.heappop(self.link)[3])
            while self.timers and self.timers[0][0] <= self.t + _EPS:
                heapq.heappop(self.timers)[2]()

    def _work(self, role: str, kind: str, seconds: float, done: Callable[[], None]) -> _Work:
        w = _Work(role, kind, seconds, done)
        if seconds <= _EPS:
            done()
        else:
            self.works.append(w)
        return w

    def _at(self, t: float, then: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (t, next(self.seq), then))

    # --- a request's way ----------------------------------------------------------------------

    def arrive(self, r: _Request) -> None:
        p = r.arrival.prefill
        self.queues[p].append(r)
        if not self.busy[p]:
            self._next_forward(p)

    def _next_forward(self, p: int) -> None:
        if not self.queues[p]:
            self.busy[p] = False
            return
        self.busy[p] = True
        r = self.queues[p].popleft()
        r.start = self.t
        if r.streams:
            self._release(r)
        self._work("prefill", "forward", self.dep.forward.seconds(r.arrival.tokens),
                   lambda: self._forward_end(r))

    def _forward_end(self, r: _Request) -> None:
        r.forward_end = self.t
        for s in list(r.pending):
            if s.sent:
                self._stream_done(s)
        if not r.streams:
            self._work("prefill", "codec", _encode_s(self.dep, self.variant, r.arrival.tokens),
                       lambda: self._release(r))
        self._next_forward(r.arrival.prefill)

    def _release(self, r: _Request) -> None:
        first, second = self.variant.stream_fractions(self.dep.fractions)
        for fraction, is_first in ((first, True), (second, False)):
            if fraction > 0:
                s = _Stream(r, is_first, self.dep.wire_s(r.arrival.tokens, fraction))
                r.pending.append(s)
                heapq.heappush(self.link, (0 if is_first else 1, self.t, next(self.seq), s))

    def _sent(self, s: _Stream) -> None:
        s.sent = True
        if not math.isnan(s.request.forward_end):
            self._stream_done(s)

    def _stream_done(self, s: _Stream) -> None:
        r = s.request
        r.pending.remove(s)
        if s.first:
            r.first_done = self.t
            if self.variant.speculative and r.pending:
                r.draft_cap = min(self.dep.costs.spec_cap, r.arrival.outputs - 1) * self.step
                r.drafting = self._work("decode", "decode", r.draft_cap, lambda: None)
        if not r.pending:
            self._work("decode", "codec", _apply_s(self.dep, self.variant, r.arrival.tokens),
                       lambda: self._ready(r))

    def _ready(self, r: _Request) -> None:
        a, fixed = r.arrival, self.dep.costs.fixed_s
        drafted = 0.0
        if r.drafting is not None:
            drafted = r.draft_cap - max(r.drafting.left, 0.0)
            if r.drafting in self.works:
                self.works.remove(r.drafting)
        if not (self.variant.speculative
                and self.t - r.first_done > _verify_s(self.dep, self.step, 1)):
            ttft = self.t + fixed
            self._at(ttft, lambda: self._work("decode", "decode", (a.outputs - 1) * self.step,
                                              lambda: None))
            self._result(r, ttft, 0, None, 0)
            return
        drafts = min(self.dep.costs.spec_cap, a.outputs - 1, int(drafted / self.step + _EPS))
        costs = self.dep.costs
        accepted = drafts if self.rng.random() < costs.spec_hold_share else min(
            drafts, int(self.rng.expovariate(1 / costs.spec_break_mean)))

        def verified() -> None:
            release = self.t + fixed
            rest = a.outputs - min(a.outputs, accepted + 2)
            self._at(release, lambda: self._work("decode", "decode", rest * self.step,
                                                 lambda: None))
            self._result(r, r.first_done + fixed, drafts, release, accepted)

        self._work("decode", "decode", _verify_s(self.dep, self.step, drafts + 1), verified)

    def _result(self, r: _Request, ttft: float, drafts: int, release: float | None,
                accepted: int) -> None:
        a = r.arrival
        r.result = RequestResult(a.tokens, a.outputs, r.start - a.t, ttft - a.t, drafts,
                                 None if release is None else release - a.t, accepted, self.step,
                                 self.clock, a.t)


def simulate_shared(dep: Deployment, variant: Variant, arrivals: list[Arrival],
                    rng: random.Random) -> list[RequestResult]:
    """Every request of `arrivals` (sorted by time) through the stations, the CPU shared."""
    box = _Box(dep, variant, rng)
    requests = [_Request(a, _streams(dep, variant, a.tokens)) for a in arrivals]
    for r in requests:
        box._at(r.arrival.t, lambda r=r: box.arrive(r))
    box.run()
    return [r.result for r in requests]
