"""The stage breakdown of a request's network-exposed TTFT from trace records
(`lynx_tools.trace_report`), and the recorder that writes them (`lynx_sglang.recorder`)."""

from __future__ import annotations

import pytest

from lynx_sglang import trace
from lynx_sglang.recorder import Recorder
from lynx_tools.trace_report import (
    CLIENT_STAGE,
    breakdown,
    format_breakdown,
    parse_rate,
    records_by_request,
)


def _write(tmp_path, speculate: bool) -> None:
    recorder = Recorder.for_process(str(tmp_path))
    t = 1000.0
    tl = trace.Trace("timeline", 7)
    tl.mark("prefill_done", t)
    tl.facts["rid"] = "r1"
    pre = trace.Trace("prefill", 7)
    for i, mark in enumerate(("submitted", "dequeued", "announcement", "anchor_posted")):
        pre.mark(mark, t + 0.01 * (i + 1))
    dec = trace.Trace("decode", 7)
    dec.mark("anchor_landed", t + 0.08)
    dec.mark("anchor_applied", t + 0.10)
    dec.mark("residual_landed", t + 0.20)
    dec.mark("residual_applied", t + 0.25)
    dec.mark("reported", t + 0.101 if speculate else t + 0.251)
    dec.facts.update(speculate=speculate, anchor_bytes=10_000_000, residual_bytes=15_000_000,
                     why="the Residual is due in 150 ms")
    req = trace.Trace("request", 7)
    req.mark("committed", dec.marks["reported"] + 0.02)
    req.mark("first_token_out", dec.marks["reported"] + 0.03)
    req.facts["rid"] = "r1"
    other = trace.Trace("decode", 8)  # another request's record must not be picked up
    other.mark("anchor_landed", t)
    for tr in (tl, pre, dec, req, other):
        recorder.emit(tr)


@pytest.mark.parametrize("speculate", [True, False])
def test_critical_path_adds_up_to_the_network_ttft(tmp_path, speculate):
    _write(tmp_path, speculate)
    records = records_by_request(tmp_path, "r1")
    assert set(records) == {"timeline", "prefill", "decode", "request"}
    client = records["request"]["marks"]["first_token_out"] + 0.005
    b = breakdown(records, "r1", client, parse_rate("1gbit"))
    assert b.speculated is speculate
    assert sum(s.seconds for s in b.stages) == pytest.approx(b.network_ttft_s)
    assert sum(s.share for s in b.stages) == pytest.approx(1.0)
    names = [s.name for s in b.stages]
    assert names[-1] == CLIENT_STAGE
    assert ("the Residual on the wire" in names) is not speculate
    assert b.wire_alone_s == pytest.approx((10e6 + (0 if speculate else 15e6)) * 8 / 1e9)
    assert "due in 150 ms" in format_breakdown(b)


def test_a_request_without_lynx_records_is_one_stage(tmp_path):
    tl = trace.Trace("timeline", 0)
    tl.mark("prefill_done", 10.0)
    tl.facts["rid"] = "m"
    Recorder.for_process(str(tmp_path)).emit(tl)
    b = breakdown(records_by_request(tmp_path, "m"), "m", 10.3)
    assert [s.seconds for s in b.stages] == [pytest.approx(0.3)] and b.speculated is None


def test_rates():
    assert parse_rate("1gbit") == 1e9 and parse_rate("10mbit") == 1e7 and parse_rate(None) is None
    with pytest.raises(ValueError, match="unknown rate"):
        parse_rate("fast")
