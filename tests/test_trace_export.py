"""`lynx_sglang.trace.export_to_sglang`: a prefill record's stages become spans of SGLang's request
trace (`--enable-trace`). SGLang's `TraceReqContext` needs an initialised OpenTelemetry exporter,
so a recording stand-in with the same methods takes its place; the call sequence it records is
what SGLang's context turns into spans."""

from __future__ import annotations

from lynx_sglang import trace


class _RecordingContext:
    tracing_enable = True

    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail = fail

    def rebuild_thread_context(self, ts=None):
        self.calls.append(("thread", ts))

    def trace_slice_start(self, name, level, ts=None):
        if self.fail:
            raise RuntimeError("exporter down")
        self.calls.append(("start", name, level, ts))

    def trace_slice_end(self, name, level, ts=None, attrs=None, thread_finish_flag=False):
        self.calls.append(("end", name, level, ts, attrs, thread_finish_flag))


def _prefill_trace(ctx) -> trace.Trace:
    tr = trace.Trace("prefill", 7, sglang_ctx=ctx)
    for i, mark in enumerate(("submitted", "dequeued", "announcement", "encode_start",
                              "anchor_posted", "encode_end", "anchor_acked")):
        tr.mark(mark, 100.0 + i / 10)
    tr.facts.update(tokens=1500, anchor_bytes=123, one_pass=False, failure=None)
    return tr


def test_stages_become_nested_spans_with_the_records_facts():
    ctx = _RecordingContext()
    trace.export_to_sglang(_prefill_trace(ctx))
    assert ctx.calls[0] == ("thread", 100_000_000_000)
    assert ctx.calls[1] == ("start", "lynx_prefill", 1, 100_000_000_000)
    inner = [c[1] for c in ctx.calls[2:-1] if c[0] == "start"]
    assert inner == ["lynx_prefill_queue", "lynx_announcement_wait", "lynx_encode",
                     "lynx_anchor_send"]
    # Each stage span starts and ends at its two marks.
    encode = [c for c in ctx.calls if c[1] == "lynx_encode"]
    assert [c[0] for c in encode] == ["start", "end"]
    assert (encode[0][3], encode[1][3]) == (100_300_000_000, 100_500_000_000)
    kind, name, level, ts, attrs, finish = ctx.calls[-1]
    assert (kind, name, level, ts, finish) == ("end", "lynx_prefill", 1, 100_600_000_000, True)
    assert attrs == {"tokens": 1500, "anchor_bytes": 123, "one_pass": False}


def test_no_context_or_tracing_off_or_a_failing_exporter_changes_nothing():
    trace.export_to_sglang(_prefill_trace(None))
    off = _RecordingContext()
    off.tracing_enable = False
    trace.export_to_sglang(_prefill_trace(off))
    assert off.calls == []
    broken = _RecordingContext(fail=True)
    trace.export_to_sglang(_prefill_trace(broken))  # logged, not raised
    assert broken.calls == [("thread", 100_000_000_000)]
