"""The cells of the fault matrix (`lynx-sglang faults`, tools/faults/run.py): the axes (target, fault,
phase, mode), the matrix's clocks (`Timing`), one cell and what it supports (`Cell`), its result
(`CellResult`), how cells are chosen (`select_cells`), and the report's table. Pure data; the
matrix itself (`matrix.Matrix`) runs them on a cluster."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
from dataclasses import dataclass, field

TARGETS = ("prefill", "decode")

FAULTS = ("sigkill", "sigstop", "partition", "rst", "slow")

PHASES = ("before-anchor", "mid-anchor", "between", "parked", "mid-residual",
          "during-verification")

MODES = ("greedy", "sampled", "client-abort")

LINK_FAULTS = ("partition", "rst", "slow")

AXES = {"targets": TARGETS, "faults": FAULTS, "phases": PHASES, "modes": MODES}

TRANSPORTS = ("tcp", "verbs")

PROMPT_TOKENS = 1500

NEXT_PROMPT_TOKENS = 256

NEW_TOKENS = 24

# A parked cell's request asks this few tokens: it reaches its length while the Residual is held,
# and speculation holds that finish back by parking the request until verification.
PARKED_NEW_TOKENS = 4

SLOW_RATE = "2mbit"

BASE_RATE = "1gbit"

# The decode's `lynx_tracked_requests` entry counting requests whose Anchor has part landed.
ANCHOR_LANDING_MAP = "decode_rooms_anchor_landing"

RESIDUAL_RATE = "20mbit"  # the exact Residual of PROMPT_TOKENS (~14 MB) then takes ~6 s

@dataclass(frozen=True)
class Timing:
    """The matrix's clocks, in s. The defaults suit this 2-core box; `scaled(f)` stretches every
    one of them for a machine f times slower (the soft-RoCE guest's emulated CPU)."""

    transfer_timeout_s: float = 15.0  # --lynx-transfer-timeout-s of both servers
    residual_hold_s: float = 4.0  # the prefill holds each Residual this long after its Anchor
    anchor_hold_s: float = 3.0  # and each Anchor this long after the first half of its layers
    verify_hold_s: float = 3.0  # the decode holds each verification this long
    before_anchor_s: float = 0.3  # after the send: the prefill still computes
    slow_s: float = 4.0  # a `slow` fault's time at SLOW_RATE
    outage_margin_s: float = 5.0  # sigstop / partition: this much past the transfer timeout
    answer_margin_s: float = 90.0  # the client's answer or error: this much past the outage
    settle_s: float = 60.0  # for slots, staging and maps to return to idle
    request_s: float = 120.0  # a client's deadline beyond the outage
    startup_s: float = 300.0  # each server's start-up
    # SGLang's own scheduler watchdog (its default): a forward longer than this kills the server
    # (measured in the soft-RoCE guest: a 512-token prefill ran past 300 s)
    watchdog_s: float = 300.0
    # SGLang's bootstrap and waiting timeouts (its defaults): a decode whose room waits longer for
    # the prefill fails it (in the guest a 40-token warm-up request ran past 300 s)
    sglang_wait_s: float = 300.0

    @property
    def outage_s(self) -> float:
        """sigstop / partition last longer than the transfer timeout: the peer must give up."""
        return self.transfer_timeout_s + self.outage_margin_s

    def scaled(self, factor: float) -> Timing:
        if factor < 1:
            raise ValueError(f"--slow-factor must be >= 1, got {factor}")
        return Timing(**{f.name: getattr(self, f.name) * factor
                         for f in dataclasses.fields(self)})


@dataclass(frozen=True)
class Cell:
    target: str
    fault: str
    phase: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.target}/{self.fault}/{self.phase}/{self.mode}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        """The cell `name` names (TARGET/FAULT/PHASE/MODE, as the report writes it); ValueError
        names the part that is not one of its axis' values."""
        parts = name.split("/")
        if len(parts) != 4:
            raise ValueError(f"{name!r}: a cell is TARGET/FAULT/PHASE/MODE, "
                             f"e.g. prefill/sigkill/between/greedy")
        for part, (axis, values) in zip(parts, AXES.items(), strict=True):
            if part not in values:
                raise ValueError(f"{name!r}: {axis} {part!r} is not one of {', '.join(values)}")
        return cls(*parts)

    def new_tokens(self, asked: int) -> int:
        """The tokens this cell's request asks, of the `asked` the matrix runs with."""
        return min(PARKED_NEW_TOKENS, asked) if self.phase == "parked" else asked

    def unsupported(self, link: bool, transport: str = "tcp",
                    windowed: bool = False) -> str | None:
        """Why this cell cannot run here, or None."""
        if windowed and self.phase in ("parked", "during-verification"):
            return ("windowed: a room sent in segments does not speculate, so it is neither "
                    "parked nor verified")
        if windowed and self.phase == "mid-anchor":
            return ("windowed: the room's Anchor goes out a segment at a time, so `between` "
                    "(after the first segment) is mid-Anchor for it")
        if self.fault in LINK_FAULTS or self.phase == "mid-residual":
            if transport == "verbs":
                return ("verbs: the soft-RoCE guest's RDMA device is not inside the shaped link's "
                        "namespaces")
            if not link:
                return "needs the shaped link between two network namespaces (root, iproute2)"
        return None


@dataclass
class CellResult:
    cell: str
    skipped: str | None = None
    outcome: str = ""  # "answer", "error: ...", "abandoned", "hung"
    phase_hit: bool = False
    seconds: float = 0.0
    checks: dict[str, bool] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    # Each server's threads and fds once the cell settled: a slow leak shows as a trend across
    # cells long before one cell crosses the slack.
    resources: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return self.skipped is not None or all(self.checks.values())


def all_cells() -> list[Cell]:
    return [Cell(*c) for c in itertools.product(TARGETS, FAULTS, PHASES, MODES)]


def select_cells(cells: list[Cell], *, targets=TARGETS, faults=FAULTS, phases=PHASES,
                 modes=MODES, sample: int | None = None, seed: int = 0,
                 link: bool = True, transport: str = "tcp", windowed: bool = False) -> list[Cell]:
    """The cells on the chosen axes; with `sample`, that many of those this machine can run,
    drawn with `seed` so that each target and fault comes up before any repeats."""
    chosen = [c for c in cells if c.target in targets and c.fault in faults
              and c.phase in phases and c.mode in modes]
    if sample is None:
        return chosen
    rng = random.Random(seed)
    runnable = [c for c in chosen if c.unsupported(link, transport, windowed) is None]
    rng.shuffle(runnable)
    picked: list[Cell] = []
    seen: set[tuple[str, str]] = set()
    for c in runnable:  # first one cell per (target, fault), then the rest in shuffled order
        if (c.target, c.fault) not in seen:
            seen.add((c.target, c.fault))
            picked.append(c)
    picked += [c for c in runnable if c not in picked]
    return picked[:sample]


def windowed_staging_mib(model: str, kv_dtype: str, prompt_tokens: int,
                         next_tokens: int) -> int:
    """`--lynx-staging-mib` for `--windowed`: the least that holds the next request whole (the
    staging pool allocates whole ranges), which must be less than the faulted request needs."""
    from lynx_kernels import CodecSpec, model_shape
    from lynx_sglang.backend.plan import StreamPlan
    from lynx_sglang.backend.staging import ALIGN

    shape = model_shape(model, kv_dtype)
    need = {n: StreamPlan.build(CodecSpec(target="exact"), shape, n, 256).staging_bytes
            for n in (prompt_tokens, next_tokens)}
    mib = -(-(-(-need[next_tokens] // ALIGN) * ALIGN) // 2**20)
    if mib << 20 >= need[prompt_tokens]:
        raise ValueError(f"--windowed: a {prompt_tokens}-token request fits the "
                         f"{mib} MiB of staging a {next_tokens}-token one needs; give a longer "
                         "--prompt-tokens")
    return mib


def brief(text: str, limit: int = 300) -> str:
    """`text` cut to `limit` characters keeping its start and its end: SGLang's abort message
    puts the request's ids first and the reason Lynx gave last."""
    if len(text) <= limit:
        return text
    head = limit // 4
    return f"{text[:head]} … {text[-(limit - head - 3):]}"


def fd_growth(baseline: collections.Counter[str], now: collections.Counter[str]) -> str:
    """The kinds of fd a process tree gained or lost since its baseline, largest change first."""
    delta = collections.Counter(now)
    delta.subtract(baseline)
    changed = sorted(((k, v) for k, v in delta.items() if v), key=lambda kv: -abs(kv[1]))
    return ", ".join(f"{k} {v:+d}" for k, v in changed) or "no change by kind"


def table(results: list[CellResult]) -> str:
    lines = ["| cell | outcome | phase hit | s | verdict |", "|---|---|---|---|---|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.cell} | skipped: {r.skipped} | | | skip |")
            continue
        failed = [k for k, v in r.checks.items() if not v]
        verdict = "clean" if not failed else "FAIL: " + "; ".join(failed)
        lines.append(f"| {r.cell} | {brief(r.outcome, 100)} | {'yes' if r.phase_hit else 'no'} | "
                     f"{r.seconds:.0f} | {verdict} |")
    return "\n".join(lines)


