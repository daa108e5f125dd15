"""Per-request traces of every stage of a Lynx transfer, as structured records.

Each producer records one `Trace` per request (room) in its own process and emits it once:
- `prefill` (`backend.prefill.sender.PrefillSender`): submitted by SGLang, dequeued, announcement seen,
  per-layer encode spans, (layer-streamed) every Anchor layer posted before SGLang's hand-over,
  each stream posted / first byte sent / acknowledged, Success reported;
- `decode` (`backend.decode.applier.DecodeApplier`): registered, staged (only a room queued for staging),
  announced, each stream's first byte and
  landing, per-layer apply spans, Success reported, the speculation decision and its reason;
- `request` (decode scheduler hooks): SGLang's first step on the request and its first token out;
- `spec` (`speculation.controller`): verification start and end, tokens speculated / accepted.

- `timeline` (`lynx_sglang.timeline`, any transfer backend): a prefill forward is done.

Producers emit through their process's `recorder.Recorder` (`Recorder.emit`), which they were
handed or find in the process's `runtime.LynxRuntime`. Sinks: one JSON object per line in
`<trace dir>/lynx-<pid>.jsonl` (`TraceSink`) when `--lynx-trace-dir` (or `names.TRACE_DIR_ENV`) is
set (the tools join the records of all processes by room and request id, `tools.trace_report`),
and, with SGLang's `--enable-metrics`, the histogram `lynx_stage_seconds{stage}` of each stage's
duration (`STAGES`). Times are wall-clock `time.time()` seconds; transport timestamps
(`time.monotonic()`) are converted when recorded.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Durations reported per stage: name -> (record kind, from mark, to mark). A stage is observed when
# its record has both marks.
STAGES: dict[str, tuple[str, str, str]] = {
    "prefill_queue": ("prefill", "submitted", "dequeued"),
    "announcement_wait": ("prefill", "dequeued", "announcement"),
    "encode": ("prefill", "encode_start", "encode_end"),
    "handover_wait": ("prefill", "anchor_layers_posted", "anchor_posted"),
    "anchor_send": ("prefill", "anchor_posted", "anchor_acked"),
    "residual_send": ("prefill", "residual_posted", "residual_acked"),
    "staging_wait": ("decode", "registered", "staged"),
    "anchor_wire": ("decode", "anchor_first_byte", "anchor_landed"),
    "anchor_apply": ("decode", "anchor_apply_start", "anchor_applied"),
    "residual_wire": ("decode", "residual_first_byte", "residual_landed"),
    "residual_apply": ("decode", "residual_apply_start", "residual_applied"),
    "report_to_first_step": ("request", "reported", "committed"),
    "first_step_to_token": ("request", "committed", "first_token_out"),
    "verify": ("spec", "verify_start", "verify_end"),
}

_MONO_TO_WALL = time.time() - time.monotonic()


def wall(mono: float | None) -> float | None:
    """A `time.monotonic()` reading as wall-clock seconds."""
    return None if mono is None else mono + _MONO_TO_WALL


@dataclass
class Trace:
    """The marks of one request in one producer. Not thread-safe: its producer owns it."""

    kind: str
    room: int
    marks: dict[str, float] = field(default_factory=dict)
    # Per-layer spans, e.g. "encode" -> [(layer, start, end), ...].
    spans: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    # SGLang's trace context of the request (`--enable-trace`), when it handed one: emitting the
    # record also exports its stages to it as OpenTelemetry spans (`export_to_sglang`).
    sglang_ctx: Any = field(default=None, repr=False, compare=False)

    def mark(self, stage: str, at: float | None = None) -> float:
        """Record `stage` now, or at wall-clock time `at`; returns the time recorded."""
        t = time.time() if at is None else at
        self.marks[stage] = t
        return t

    def mark_mono(self, stage: str, mono: float | None) -> None:
        """Record `stage` at a `time.monotonic()` reading (ignored when None)."""
        if mono is not None:
            self.marks[stage] = mono + _MONO_TO_WALL

    def span(self, name: str, layer: int, start: float, end: float) -> None:
        self.spans.setdefault(name, []).append((layer, start, end))

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "room": self.room, "pid": os.getpid(),
                "marks": {k: round(v, 6) for k, v in self.marks.items()},
                "spans": {k: [[layer, round(a, 6), round(b, 6)] for layer, a, b in v]
                          for k, v in self.spans.items()},
                "facts": self.facts}


class TraceSink:
    """A process's trace file: one JSON record per line in `<directory>/lynx-<pid>.jsonl`, opened at
    the first record (nothing is written without a directory). Thread-safe; one per process, held
    by its `recorder.Recorder`, which writes every emitted record here."""

    def __init__(self, directory: str | None):
        self._dir = Path(directory) if directory else None
        self._file = None
        self._lock = threading.Lock()

    def write(self, trace: Trace) -> None:
        if self._dir is None:
            return
        line = json.dumps(trace.record()) + "\n"
        with self._lock:
            try:
                if self._file is None:
                    self._dir.mkdir(parents=True, exist_ok=True)
                    # Kept open for the process's life: one file per process.
                    self._file = open(self._dir / f"lynx-{os.getpid()}.jsonl", "a")  # noqa: SIM115
                self._file.write(line)
                self._file.flush()
            except OSError as exc:
                # Tracing must never fail a request: say so once and stop writing.
                logger.error("lynx trace: cannot write to %s (%s); tracing to files stops",
                             self._dir, exc)
                self._dir = None


def stage_durations(trace: Trace) -> list[tuple[str, float, float]]:
    """(stage, start, end) of every stage of `STAGES` that `trace` has both marks of."""
    return [(stage, trace.marks[start], trace.marks[end])
            for stage, (kind, start, end) in STAGES.items()
            if kind == trace.kind and start in trace.marks and end in trace.marks]


def export_to_sglang(trace: Trace) -> None:
    """Write the record as spans into SGLang's request trace (`trace.sglang_ctx`, a
    `TraceReqContext`, used duck-typed): one `lynx_<kind>` span from the first mark to the last,
    carrying the record's facts, with one child span per stage of `STAGES` it has both marks of.
    Called once, after the fact, on the thread that emits (SGLang's context is per thread)."""
    ctx = trace.sglang_ctx
    if ctx is None or not getattr(ctx, "tracing_enable", False) or not trace.marks:
        return
    ns = lambda t: int(t * 1e9)  # noqa: E731 - SGLang's slices take wall-clock nanoseconds
    root = f"lynx_{trace.kind}"
    attrs = {k: v for k, v in trace.facts.items() if isinstance(v, (str, int, float, bool))}
    try:
        ctx.rebuild_thread_context(ns(min(trace.marks.values())))
        ctx.trace_slice_start(root, 1, ns(min(trace.marks.values())))
        for stage, start, end in stage_durations(trace):
            ctx.trace_slice_start(f"lynx_{stage}", 2, ns(start))
            ctx.trace_slice_end(f"lynx_{stage}", 2, ns(end))
        ctx.trace_slice_end(root, 1, ns(max(trace.marks.values())), attrs=attrs,
                            thread_finish_flag=True)
    except Exception as exc:
        # Tracing must never fail a request.
        logger.warning("lynx trace: exporting room %s to SGLang's trace failed: %s",
                       trace.room, exc)


def read_records(directory: str | Path) -> list[dict]:
    """Every record in a trace directory (all processes), in file then line order."""
    out = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out
