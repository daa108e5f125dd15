"""Lets SGLang's scheduler loop sleep while it only waits on transfers, instead of spinning, and
publishes the sizes of Lynx's per-request maps from that loop.

SGLang's PD scheduler loops call `Scheduler.on_idle` when no batch is ready; while a request is
still transferring, the scheduler is "not fully idle" and `on_idle` returns after a bare
`time.sleep(0)`, so the loop spins on a whole core, polling the transfer queues. With Mooncake the
transfer runs in C++ threads and does not notice; Lynx encodes and applies the KV in the same
process, and on a small CPU the two spinning schedulers (prefill and decode) took the cores the
codec and the prefill's forward needed.

`IdleWaiter` is one scheduler's wait, built with its KV manager (`runtime.LynxRuntime.idle`). The
AROUND hook on `on_idle` (`hooks.on_idle_around`, registered by `lynx_sglang.plugin` in Lynx
scheduler processes) finds it through the scheduler's KV manager; it sleeps in one poll until
something the loop would act on happens: a message on the scheduler's input sockets (a new
request, an abort, an RPC: the same sockets SGLang's own `IdleSleeper` watches) or the backend's
progress (`IdleWaiter.notify`: every status change of a transfer, a Residual applied under a
speculative request), or `max_wait_s()` at the latest, which bounds the loop's time-based work
(SGLang's bootstrap and waiting timeouts, heartbeats, metrics). Polling at a fixed 2 ms instead
cost the decode's scheduler 0.15-0.2 of a core during every prefill forward, taken from that
forward where prefill and decode share a box.

With tensor parallelism the wait is `WAIT_S` at most on every rank: ranks > 0 have no input
sockets to watch (their requests come by broadcast from rank 0), and SGLang agrees a transfer's
status by an all-reduce over all ranks, so rank 0 must not sleep through a peer's progress, which
wakes only the peer.

With IDLE_WAIT_ENV=1 the hook is registered in the schedulers of any transfer backend too: a
benchmark baseline (`mooncake-nospin`) whose decode then no longer takes a core from a prefill
computing on the same box. There the plugin attaches a runtime holding only the waiter to that
backend's KV manager, and an AFTER hook on SGLang's `CommonKVManager.update_status`, through which
every backend's transfer statuses pass, calls its `notify` (`hooks.status_updated_after`).

About once a second (`REPORT_EVERY_S`), before SGLang's idle path may put the loop to sleep, the
waiter also calls every function given to `IdleWaiter.report_tracked` (the backend's and
speculation's map sizes -> `lynx_tracked_requests`) and `IdleWaiter.report_listener` (the tcp
data listener's counters -> `lynx_tcp_listener_events`), so a leak checker or an operator reading
/metrics of an idle server sees current values.

Called by SGLang's scheduler thread (`IdleWaiter.on_idle`) and by the backends' threads
(`IdleWaiter.notify`).
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable

import zmq

from .metrics import Metrics
from .names import IDLE_MAX_WAIT_ENV, IDLE_WAIT_ENV

# The wait where the poll cannot see all that should end it: no input sockets on this rank, or
# TP peers whose progress wakes only their own process.
WAIT_S = 0.002
# The wait where the backend notifies its progress: long enough that a scheduler waiting on a
# transfer wakes a few dozen times a second, short against SGLang's time-based checks (seconds).
MAX_WAIT_S = 0.05
REPORT_EVERY_S = 1.0


def wait_for_all_backends() -> bool:
    """IDLE_WAIT_ENV=1: the idle wait for the schedulers of any transfer backend."""
    return os.environ.get(IDLE_WAIT_ENV) == "1"


def max_wait_s() -> float:
    """The longest idle wait of a Lynx scheduler (IDLE_MAX_WAIT_ENV, else MAX_WAIT_S)."""
    raw = os.environ.get(IDLE_MAX_WAIT_ENV)
    if raw is None:
        return MAX_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{IDLE_MAX_WAIT_ENV}={raw!r}: expected seconds, e.g. 0.05") from None
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{IDLE_MAX_WAIT_ENV}={raw!r}: must be in (0, 1] seconds")
    return value


class _Wakeup:
    """A pipe any thread can write one byte to, so that a poll on its read end returns: the
    scheduler's poll watches zmq sockets, which a threading.Event cannot join."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def set(self) -> None:
        # A full pipe holds wake-ups nobody has drained yet: the next poll returns anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self.write_fd, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.read_fd, 4096):
                pass


def _input_sockets(scheduler) -> list[zmq.Socket]:
    channels = getattr(scheduler, "ipc_channels", None)
    found = [getattr(channels, name, None) for name in ("recv_from_tokenizer", "recv_from_rpc")]
    return [s for s in found if isinstance(s, zmq.Socket)]


class _IdlePoll:
    """One scheduler's poll over its input sockets and its waiter's wake-up pipe."""

    def __init__(self, scheduler, wakeup: _Wakeup, timeout_s: float):
        self.scheduler = weakref.ref(scheduler)
        self.wakeup = wakeup
        self.poller = zmq.Poller()
        sockets = _input_sockets(scheduler)
        for s in sockets:
            self.poller.register(s, zmq.POLLIN)
        self.poller.register(self.wakeup.read_fd, zmq.POLLIN)
        # Without the sockets only the backend could wake us, and unseen input must not wait
        # long. With TP peers, a transfer's status is agreed by an all-reduce over every rank's
        # poll, and a peer rank's progress wakes only that rank's process.
        alone = getattr(scheduler, "tp_size", 1) == 1
        self.timeout_ms = 1e3 * (timeout_s if sockets and alone else min(timeout_s, WAIT_S))

    def wait(self) -> None:
        self.poller.poll(self.timeout_ms)
        self.wakeup.clear()


class IdleWaiter:
    """One scheduler's idle wait: the wake-up pipe its backend notifies (`notify`, any thread),
    the poll over the scheduler's input sockets and that pipe (`on_idle`, the scheduler thread),
    and the map sizes it publishes from there. Built at start-up, with its KV manager: the pipe's
    two fds belong to the process's baseline, not to its first request. The map sizes go to
    `metrics`, the process's (`recorder.Recorder.metrics`)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self.max_wait_s = max_wait_s()
        self._wakeup = _Wakeup()
        self._reporters: list[Callable[[], dict[str, int]]] = []
        self._listener_counters: list[Callable[[], dict[str, int]]] = []
        self._last_report = 0.0
        self._poll: _IdlePoll | None = None

    def notify(self) -> None:
        """A transfer's status changed: wake a waiting scheduler loop now."""
        self._wakeup.set()

    def report_tracked(self, sizes: Callable[[], dict[str, int]]) -> None:
        """Publish `sizes()` (map name -> entries) from the scheduler loop about once a second."""
        self._reporters.append(sizes)

    def report_listener(self, counters: Callable[[], dict[str, int]]) -> None:
        """Publish `counters()` (a tcp data listener's event counts) about once a second."""
        self._listener_counters.append(counters)

    def on_idle(self, original, scheduler, *args, **kwargs):
        """SGLang's `on_idle`, then a wait for input or a transfer's progress, `max_wait_s` at
        most, unless the scheduler is fully idle (SGLang's own idle path then sleeps)."""
        self._maybe_report()
        if scheduler.is_fully_idle():
            return original(scheduler, *args, **kwargs)
        result = original(scheduler, *args, **kwargs)  # SGLang only yields with sleep(0)
        if self._poll is None or self._poll.scheduler() is not scheduler:
            self._poll = _IdlePoll(scheduler, self._wakeup, self.max_wait_s)
        self._poll.wait()
        return result

    def _maybe_report(self) -> None:
        now = time.monotonic()
        if not (self._reporters or self._listener_counters) or (
                now - self._last_report < REPORT_EVERY_S):
            return
        self._last_report = now
        for sizes in self._reporters:
            self._metrics.record_tracked(sizes())
        for counters in self._listener_counters:
            self._metrics.record_listener(counters())
