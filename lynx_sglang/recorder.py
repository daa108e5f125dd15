"""Where one scheduler process's records go (`Recorder`): its metric series (`metrics.Metrics`,
labelled with the process's identity) and its trace records (`trace.TraceSink`, the process's
trace file; each record's stage durations also become `lynx_stage_seconds`, and its stages spans
of SGLang's request trace).

Built once per process: by the KV manager (`backend.manager.LynxKVManager`, with the process's
labels and `--lynx-trace-dir`), which holds it in its `runtime.LynxRuntime` and hands it to the
components that record (the prefill sender, the decode applier, the staging pool, the idle waiter,
the speculation controller); where another backend's scheduler records (the idle wait's runtime,
the timeline), by the plugin with the default labels. Thread-safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .metrics import Metrics
from .names import TRACE_DIR_ENV
from .trace import Trace, TraceSink, export_to_sglang, stage_durations


@dataclass(frozen=True)
class Recorder:
    """One process's metric series and trace sink (see the module)."""

    metrics: Metrics
    traces: TraceSink

    @classmethod
    def for_process(cls, trace_dir: str | None = None, metrics: Metrics | None = None) -> Recorder:
        """The process's recorder: traces to `trace_dir` (None: `TRACE_DIR_ENV`, else to no file,
        histograms only), series labelled by `metrics` (None: another backend's process, whose
        labels are unknown here)."""
        return cls(metrics or Metrics(), TraceSink(trace_dir or os.environ.get(TRACE_DIR_ENV)))

    def emit(self, trace: Trace) -> None:
        """A producer's finished record: its stage histograms, its line in the trace file, and its
        spans in SGLang's request trace (on the calling thread: SGLang's context is per thread)."""
        for stage, start, end in stage_durations(trace):
            self.metrics.record_stage(stage, end - start)
        self.traces.write(trace)
        export_to_sglang(trace)
