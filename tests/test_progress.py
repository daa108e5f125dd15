"""The progress lines of `lynx-sglang demo` / `bench-ttft` (lynx_tools.progress), on a fake
clock: variant i/N, rate-limited start-up waits, request j/M, and the ETA once a variant is done."""

from __future__ import annotations

import io

import pytest

from lynx_tools.progress import Progress


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def run():
    out, clock = io.StringIO(), FakeClock()
    return Progress("bench-ttft", 3, stream=out, clock=clock), out, clock


def test_lines_of_a_run(run):
    progress, out, clock = run
    assert progress.eta_s() is None
    start = clock.now
    progress.start_variant("mooncake")
    for elapsed in (1, 5, 9, 11, 12):  # one line per wait_every_s (10 s) at most
        clock.now = start + elapsed
        progress.waiting(["prefill", "decode"], elapsed)
    progress.request(1, 2, "(client)")
    progress.note("warm-up failed: boom")
    clock.now = start + 100
    progress.finish_variant()
    assert progress.eta_s() == pytest.approx(200.0)
    progress.start_variant("lynx", "starting cluster (logs /x)")
    clock.now += 50
    progress.finish_variant()
    assert progress.eta_s() == pytest.approx(75.0)  # one left x mean(100, 50)
    progress.start_variant("int4-anchor")
    clock.now += 30
    progress.finish_variant()
    assert progress.eta_s() == 0
    assert out.getvalue().splitlines() == [
        "[bench-ttft] variant 1/3 mooncake: starting cluster",
        "[bench-ttft] variant 1/3 mooncake: waiting for prefill, decode ready … 11 s",
        "[bench-ttft] variant 1/3 mooncake: request 1/2 (client)",
        "[bench-ttft] variant 1/3 mooncake: warm-up failed: boom",
        "[bench-ttft] variant 1/3 mooncake: done in 1 min 40 s; ETA 3 min 20 s for 2 more",
        "[bench-ttft] variant 2/3 lynx: starting cluster (logs /x)",
        "[bench-ttft] variant 2/3 lynx: done in 50 s; ETA 1 min 15 s for 1 more",
        "[bench-ttft] variant 3/3 int4-anchor: starting cluster",
        "[bench-ttft] variant 3/3 int4-anchor: done in 30 s",
    ]


def test_default_stream_is_stderr_at_write_time(capsys):
    Progress("demo", 1).start_variant("lynx")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "[demo] variant 1/1 lynx: starting cluster\n"


def test_a_phase_of_every_variant(run):
    progress, out, _ = run
    progress.start_variant("mooncake")
    progress.phase("interleaved, 2 clusters up")
    progress.note("lynx: request 1/4 (client)")
    assert out.getvalue().splitlines()[-1] == (
        "[bench-ttft] interleaved, 2 clusters up: lynx: request 1/4 (client)")
