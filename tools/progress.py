"""Progress lines of the tools that run cluster after cluster (`lynx-sglang demo`, `bench-ttft`),
on stderr so that stdout keeps only the results: which variant of how many, the start-up waits,
which request, and once a variant has finished an estimate of the time left (variants left × the
mean time of the finished ones). A run takes minutes per variant on a small CPU box; without these
lines it looks hung.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


@dataclass
class Progress:
    """`tool` prefixes every line; `variants` is the number of variants the run measures."""

    tool: str
    variants: int
    # None: sys.stderr looked up per line, so a redirected or captured stderr gets the lines.
    stream: TextIO | None = None
    clock: Callable[[], float] = time.monotonic
    # The cluster reports a wait about once a second; one line per this many seconds is enough.
    wait_every_s: float = 10.0
    index: int = field(default=0, init=False)
    name: str = field(default="", init=False)
    durations_s: list[float] = field(default_factory=list, init=False)
    _variant_start: float = field(default=0.0, init=False)
    _last_line: float = field(default=0.0, init=False)
    _phase: str = field(default="", init=False)

    def _line(self, msg: str) -> None:
        where = self._phase or f"variant {self.index}/{self.variants} {self.name}"
        print(f"[{self.tool}] {where}: {msg}", file=self.stream or sys.stderr, flush=True)
        self._last_line = self.clock()

    def phase(self, what: str) -> None:
        """Lines from here on belong to `what`, not to one variant (bench-ttft --interleave
        sends to every variant in turn once all their clusters are up)."""
        self._phase = what

    def start_variant(self, name: str, what: str = "starting cluster") -> None:
        self.index += 1
        self.name = name
        self._variant_start = self.clock()
        self._line(what)

    def note(self, msg: str) -> None:
        self._line(msg)

    def waiting(self, names: list[str], elapsed_s: float) -> None:
        """A start-up wait (`tools.cluster.local.Cluster`'s `on_wait`)."""
        if self.clock() - self._last_line >= self.wait_every_s:
            self._line(f"waiting for {', '.join(names)} ready … {elapsed_s:.0f} s")

    def request(self, number: int, total: int, what: str = "") -> None:
        self._line(f"request {number}/{total}" + (f" {what}" if what else ""))

    def eta_s(self) -> float | None:
        """Seconds the variants not yet finished should take; None before one has finished."""
        if not self.durations_s:
            return None
        return (self.variants - len(self.durations_s)) * statistics.mean(self.durations_s)

    def finish_variant(self) -> None:
        took = self.clock() - self._variant_start
        self.durations_s.append(took)
        left = self.variants - len(self.durations_s)
        eta = f"; ETA {_duration(self.eta_s())} for {left} more" if left else ""
        self._line(f"done in {_duration(took)}{eta}")
