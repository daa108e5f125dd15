"""Lets SGLang's scheduler loop sleep while it only waits on transfers, instead of spinning, and
publishes the sizes of Lynx's per-request maps from that loop.

SGLang's PD scheduler loops call `Scheduler.on_idle` when no batch is ready; while a request is
still transferring, the scheduler is "not fully idle" and `on_idle` returns after a bare
`time.sleep(0)`, so the loop spins on a whole core, polling the transfer queues. With Mooncake the
transfer runs in C++ threads and does not notice; Lynx encodes and applies the KV in the same
process, and on a small CPU the two spinning schedulers (prefill and decode) took the cores the
codec needed. The AROUND hook on `on_idle` (registered by `lynx_sglang.plugin` in Lynx scheduler
processes) waits instead, up to `WAIT_S` or until the backend reports progress (`notify`: a status
decided, a Success or a failure), whichever comes first. A request arriving meanwhile is picked
up at most `WAIT_S` later.

With IDLE_WAIT_ENV=1 the hook is registered in the schedulers of any transfer backend too: a
benchmark baseline (`mooncake-nospin`) whose decode then no longer takes a core from a prefill
computing on the same box. The wait is then bounded by `WAIT_S` alone (no Lynx backend notifies).

About once a second (`REPORT_EVERY_S`), before SGLang's idle path may put the loop to sleep, the
hook also calls every function given to `report_tracked` (the backend's and speculation's map
sizes -> `lynx_tracked_requests`), so a leak checker reading /metrics of an idle server sees
current values.

Called by SGLang's scheduler thread (`on_idle_around`) and by the backend's threads (`notify`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from . import metrics
from .names import IDLE_WAIT_ENV

WAIT_S = 0.002
REPORT_EVERY_S = 1.0
_progress = threading.Event()
_reporters: list[Callable[[], dict[str, int]]] = []
_last_report = 0.0


def wait_for_all_backends() -> bool:
    """IDLE_WAIT_ENV=1: the idle wait for the schedulers of any transfer backend."""
    return os.environ.get(IDLE_WAIT_ENV) == "1"


def notify() -> None:
    """A transfer's status changed: wake a waiting scheduler loop now."""
    _progress.set()


def report_tracked(sizes: Callable[[], dict[str, int]]) -> None:
    """Publish `sizes()` (map name -> entries) from the scheduler loop about once a second."""
    _reporters.append(sizes)


def _maybe_report() -> None:
    global _last_report
    now = time.monotonic()
    if not _reporters or now - _last_report < REPORT_EVERY_S:
        return
    _last_report = now
    for sizes in _reporters:
        metrics.record_tracked(sizes())


def on_idle_around(original, scheduler, *args, **kwargs):
    _maybe_report()
    if scheduler.is_fully_idle():
        return original(scheduler, *args, **kwargs)
    result = original(scheduler, *args, **kwargs)  # SGLang only yields with sleep(0)
    _progress.wait(WAIT_S)
    _progress.clear()
    return result
