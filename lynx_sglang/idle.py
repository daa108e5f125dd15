"""Lets SGLang's scheduler loop sleep while it only waits on transfers, instead of spinning.

SGLang's PD scheduler loops call `Scheduler.on_idle` when no batch is ready; while a request is
still transferring, the scheduler is "not fully idle" and `on_idle` returns after a bare
`time.sleep(0)`, so the loop spins on a whole core, polling the transfer queues. With Mooncake the
transfer runs in C++ threads and does not notice; Lynx encodes and applies the KV in the same
process, and on a small CPU the two spinning schedulers (prefill and decode) took the cores the
codec needed. The AFTER hook on `on_idle` (registered by `lynx_sglang.plugin` in Lynx scheduler
processes) waits instead, up to `WAIT_S` or until the backend reports progress (`notify`: a status
decided, a Success or a failure), whichever comes first. A request arriving meanwhile is picked
up at most `WAIT_S` later.

Called by SGLang's scheduler thread (`on_idle_after`) and by the backend's threads (`notify`).
"""

from __future__ import annotations

import threading

WAIT_S = 0.002
_progress = threading.Event()


def notify() -> None:
    """A transfer's status changed: wake a waiting scheduler loop now."""
    _progress.set()


def on_idle_after(result, scheduler, *args, **kwargs):
    if not scheduler.is_fully_idle():  # SGLang only yielded with sleep(0): wait a little
        _progress.wait(WAIT_S)
        _progress.clear()
    return result
