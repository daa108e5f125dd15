"""The process's recorder (`lynx_sglang.recorder.Recorder`): every emitted record becomes one line
of the process's trace file, in the directory given or else `names.TRACE_DIR_ENV`, and its stages
spans of SGLang's request trace; without a directory nothing is written."""

from __future__ import annotations

import json
import os

from lynx_sglang.names import TRACE_DIR_ENV
from lynx_sglang.recorder import Recorder
from lynx_sglang.trace import Trace


class _Context:
    tracing_enable = True

    def __init__(self):
        self.slices: list[str] = []

    def rebuild_thread_context(self, ts=None):
        pass

    def trace_slice_start(self, name, level, ts=None):
        self.slices.append(name)

    def trace_slice_end(self, name, level, ts=None, attrs=None, thread_finish_flag=False):
        pass


def _record(ctx=None) -> Trace:
    tr = Trace("decode", 5, sglang_ctx=ctx)
    tr.mark("anchor_first_byte", 1.0)
    tr.mark("anchor_landed", 1.5)
    tr.facts["rid"] = "r5"
    return tr


def test_records_go_to_one_file_per_process_and_to_sglangs_trace(tmp_path):
    ctx = _Context()
    recorder = Recorder.for_process(str(tmp_path))
    recorder.emit(_record(ctx))
    recorder.emit(_record())
    lines = (tmp_path / f"lynx-{os.getpid()}.jsonl").read_text().splitlines()
    assert [json.loads(line)["facts"] for line in lines] == [{"rid": "r5"}] * 2
    assert json.loads(lines[0])["marks"] == {"anchor_first_byte": 1.0, "anchor_landed": 1.5}
    assert ctx.slices == ["lynx_decode", "lynx_anchor_wire"]


def test_the_directory_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "env"))
    Recorder.for_process().emit(_record())
    assert len(list((tmp_path / "env").glob("lynx-*.jsonl"))) == 1
    monkeypatch.delenv(TRACE_DIR_ENV)
    Recorder.for_process().emit(_record())  # no directory: histograms only, no file
    assert [p.name for p in tmp_path.iterdir()] == ["env"]
