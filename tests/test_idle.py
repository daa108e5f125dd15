"""The scheduler's idle wait (lynx_sglang.idle) on a stand-in scheduler: SGLang's own `on_idle`
returns at once while a transfer is in flight, so the loop would spin; the hook sleeps in one poll
over the scheduler's input sockets (real zmq sockets here) and the backend's wake-up, until one of
them has something or the longest wait has passed. A stand-in because SGLang's Scheduler is only
built inside a server process with a model; the hook finds the `IdleWaiter` the way it does there
(the runtime of the KV manager of the scheduler's PD queue). The hook in real servers is exercised
by the PD tests (tests/sglang/test_pd_lynx*.py) and measured by `bench-ttft` (variants
`lynx-poll2ms` and `mooncake-nospin`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest
import zmq

from lynx_sglang import hooks, idle
from lynx_sglang.names import IDLE_MAX_WAIT_ENV, IDLE_WAIT_ENV
from lynx_sglang.recorder import Recorder
from lynx_sglang.runtime import LynxRuntime, attach


@dataclass
class Channels:
    recv_from_tokenizer: object = None
    recv_from_rpc: object = None


class KVManager:
    """Stands in for the KV manager SGLang built (another backend's: the runtime is attached)."""


@dataclass
class Queue:
    kv_manager: KVManager


class Scheduler:
    def __init__(self, fully_idle: bool, manager: KVManager | None = None,
                 channels: Channels | None = None, tp_size: int = 1):
        self.fully_idle = fully_idle
        self.disagg_decode_prealloc_queue = Queue(manager or _manager())
        self.ipc_channels = channels or Channels()
        self.tp_size = tp_size
        self.calls = 0

    def is_fully_idle(self) -> bool:
        return self.fully_idle

    def on_idle(self) -> str:
        self.calls += 1
        return "idle"


@pytest.fixture
def tokenizer_link():
    """The scheduler's input socket (PULL, as SGLang's) and the tokenizer's end (PUSH)."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    pull.close(0)
    push.close(0)
    ctx.term()


def _manager() -> KVManager:
    manager = KVManager()
    recorder = Recorder.for_process()
    attach(manager, LynxRuntime(idle=idle.IdleWaiter(recorder.metrics), recorder=recorder))
    return manager


def _waiter(s: Scheduler) -> idle.IdleWaiter:
    return s.disagg_decode_prealloc_queue.kv_manager.lynx_runtime.idle


def _timed(fn, *args) -> float:
    t0 = time.monotonic()
    fn(*args)
    return time.monotonic() - t0


def _on_idle(scheduler: Scheduler) -> str:
    return hooks.on_idle_around(Scheduler.on_idle, scheduler)


def test_a_transfer_in_flight_sleeps_until_the_longest_wait(monkeypatch, tokenizer_link):
    monkeypatch.setenv(IDLE_MAX_WAIT_ENV, "0.2")
    s = Scheduler(fully_idle=False, channels=Channels(recv_from_tokenizer=tokenizer_link[0]))
    _waiter(s).notify()
    _on_idle(s)  # a wake-up left over from before is consumed, not carried into the next wait
    assert s.calls == 1
    # one 0.2 s poll, where the old loop woke every 2 ms (and a spinning one every microsecond)
    assert _timed(_on_idle, s) >= 0.18
    assert s.calls == 2


def test_a_new_request_wakes_the_wait_at_once(monkeypatch, tokenizer_link):
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    pull, push = tokenizer_link
    s = Scheduler(fully_idle=False, channels=Channels(recv_from_tokenizer=pull))
    threading.Timer(0.05, push.send, args=(b"request",)).start()
    assert _timed(_on_idle, s) < 10.0
    # the message is left for SGLang's own receive loop
    assert pull.recv(zmq.NOBLOCK) == b"request"


def test_the_backends_progress_wakes_the_wait_at_once(monkeypatch, tokenizer_link):
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    s = Scheduler(fully_idle=False, channels=Channels(recv_from_tokenizer=tokenizer_link[0]))
    threading.Timer(0.05, _waiter(s).notify).start()
    assert _timed(_on_idle, s) < 10.0


def test_a_progress_before_the_wait_is_not_lost(monkeypatch, tokenizer_link):
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    manager = _manager()
    s = Scheduler(fully_idle=False, manager=manager,
                  channels=Channels(recv_from_tokenizer=tokenizer_link[0]))
    _on_idle(Scheduler(fully_idle=True, manager=manager))
    _waiter(s).notify()  # e.g. a Success decided while the loop was still polling its queues
    assert _timed(_on_idle, s) < 10.0


def test_without_input_sockets_the_wait_stays_short(monkeypatch):
    """A TP rank > 0 gets its requests by broadcast, which no poll can see."""
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    s = Scheduler(fully_idle=False)
    n = 20
    elapsed = sum(_timed(_on_idle, s) for _ in range(n))
    assert n * idle.WAIT_S * 0.8 <= elapsed < 10.0


def test_with_tp_peers_the_wait_stays_short(monkeypatch, tokenizer_link):
    """SGLang all-reduces a transfer's status over the TP ranks: a peer's progress cannot wake
    rank 0, which must look again soon."""
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    s = Scheduler(fully_idle=False, channels=Channels(recv_from_tokenizer=tokenizer_link[0]),
                  tp_size=2)
    n = 20
    elapsed = sum(_timed(_on_idle, s) for _ in range(n))
    assert n * idle.WAIT_S * 0.8 <= elapsed < 10.0


def test_another_backends_status_change_wakes_the_wait(monkeypatch, tokenizer_link):
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    manager = _manager()
    s = Scheduler(fully_idle=False, manager=manager,
                  channels=Channels(recv_from_tokenizer=tokenizer_link[0]))
    threading.Timer(0.05, hooks.status_updated_after,
                    args=("result", manager, 7, "Success")).start()
    assert _timed(_on_idle, s) < 10.0
    assert hooks.status_updated_after("result", manager) == "result"


def test_a_scheduler_without_a_runtime_is_left_to_sglang():
    """Another backend's scheduler without the idle wait, or one whose KV manager is not built."""
    s = Scheduler(fully_idle=False)
    s.disagg_decode_prealloc_queue = None
    assert _on_idle(s) == "idle"
    assert s.calls == 1
    assert hooks.status_updated_after("result", KVManager()) == "result"


def test_a_fully_idle_scheduler_is_left_to_sglang(monkeypatch):
    monkeypatch.setattr(idle, "MAX_WAIT_S", 30.0)
    s = Scheduler(fully_idle=True)
    assert _timed(_on_idle, s) < 10.0  # no wait of ours: SGLang's own idle path sleeps
    assert s.calls == 1


@pytest.mark.parametrize("value", ["soon", "0", "-1", "5"])
def test_a_bad_longest_wait_fails_at_registration(monkeypatch, value):
    monkeypatch.setenv(IDLE_MAX_WAIT_ENV, value)
    with pytest.raises(ValueError, match=IDLE_MAX_WAIT_ENV):
        idle.max_wait_s()


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, False)])
def test_the_idle_wait_for_other_backends_is_opt_in(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(IDLE_WAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(IDLE_WAIT_ENV, value)
    assert idle.wait_for_all_backends() is expected
