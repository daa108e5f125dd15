"""The scheduler's idle wait (lynx_sglang.idle) on a stand-in scheduler: SGLang's own `on_idle`
returns at once while a transfer is in flight, so the loop would spin; the hook waits up to
WAIT_S or until a backend reports progress. A stand-in because SGLang's Scheduler is only built
inside a server process with a model; the hook in real servers is exercised by the PD tests
(tests/sglang/test_pd_lynx*.py) and measured by `bench-ttft` (variant mooncake-nospin)."""

from __future__ import annotations

import threading
import time

import pytest

from lynx_sglang import idle
from lynx_sglang.names import IDLE_WAIT_ENV


class Scheduler:
    def __init__(self, fully_idle: bool):
        self.fully_idle = fully_idle
        self.calls = 0

    def is_fully_idle(self) -> bool:
        return self.fully_idle

    def on_idle(self) -> str:
        self.calls += 1
        return "idle"


def _on_idle(scheduler: Scheduler) -> str:
    return idle.on_idle_around(Scheduler.on_idle, scheduler)


def test_a_transfer_in_flight_waits_instead_of_spinning():
    s = Scheduler(fully_idle=False)
    n, t0 = 20, time.monotonic()
    for _ in range(n):
        assert _on_idle(s) == "idle"
    # each call waited about WAIT_S: a spinning loop does 20 calls in microseconds
    assert time.monotonic() - t0 >= n * idle.WAIT_S * 0.9
    assert s.calls == n


def test_progress_wakes_the_wait_at_once(monkeypatch):
    monkeypatch.setattr(idle, "WAIT_S", 30.0)
    s = Scheduler(fully_idle=False)
    threading.Timer(0.05, idle.notify).start()
    t0 = time.monotonic()
    _on_idle(s)
    assert time.monotonic() - t0 < 10.0


def test_a_fully_idle_scheduler_is_left_to_sglang(monkeypatch):
    monkeypatch.setattr(idle, "WAIT_S", 30.0)
    t0 = time.monotonic()
    assert _on_idle(Scheduler(fully_idle=True)) == "idle"
    assert time.monotonic() - t0 < 10.0  # no wait of ours: SGLang's own idle path sleeps


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, False)])
def test_the_idle_wait_for_other_backends_is_opt_in(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(IDLE_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(IDLE_WAIT_ENV, value)
    assert idle.wait_for_all_backends() is expected
