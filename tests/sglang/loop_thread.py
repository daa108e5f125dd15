"""A component's stoppable loop (`DecodeApplier.accept_loop`, `DecodeApplier.run`,
`PrefillSender.run`: each returns once the event it is handed is set) on its own daemon thread
for a `with` block, stopped and joined after it; `until` polls for what the loop should bring
about, by a deadline counted from the start. Used by test_hostile_inputs.py and
test_status_race.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class LoopThread:
    def __init__(self, loop: Callable[[threading.Event], object], join_s: float = 2.0):
        self.stop = threading.Event()
        self.join_s = join_s
        self.thread = threading.Thread(target=loop, args=(self.stop,), daemon=True)

    def __enter__(self) -> LoopThread:
        self.t0 = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(self.join_s)

    def until(self, done: Callable[[], bool], within_s: float, why: str) -> None:
        while not done():
            assert time.monotonic() - self.t0 < within_s, why
            time.sleep(0.01)
