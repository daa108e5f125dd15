"""Opt-in timeline of a prefill server: one `lynx timeline {json}` log line and one `timeline`
trace record (`lynx_sglang.trace`) per request when its prefill forward has finished (before
SGLang hands its KV to the transfer backend).

Enabled by the plugin in scheduler processes when `LYNX_SGLANG_TIMELINE=1` (any transfer backend,
so the demo can compare `lynx` and `mooncake_tcp` on the same clock); read back by the tools with
`names.parse_records(log, names.TIMELINE_RECORD)`. Times are wall-clock `time.time()` seconds, so
they compare with the client's and the decode's `lynx transfer` times on the same machine.
"""

from __future__ import annotations

import logging
import os
import time

from . import runtime
from .names import TIMELINE_ENV, TIMELINE_RECORD, record_line
from .recorder import Recorder
from .trace import Trace
from .upstream.sglang_names import is_prefill_scheduler

logger = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get(TIMELINE_ENV) == "1"


class PrefillTimeline:
    """One scheduler process's timeline hook (`prefill_done_before`), built and registered by the
    plugin. Its records go to the process's recorder: the Lynx runtime's where the scheduler has
    one, else this hook's own (another backend, whose scheduler has no Lynx runtime), built with
    the hook so that the process keeps one trace file."""

    def __init__(self):
        self._own = Recorder.for_process()

    def prefill_done_before(self, scheduler, batch, result):
        """BEFORE hook on Scheduler.process_batch_result: log finished prefill forwards."""
        if not is_prefill_scheduler(scheduler):
            return None
        if not batch.forward_mode.is_extend():
            return None
        rt = runtime.of_scheduler(scheduler)
        recorder = self._own if rt is None else rt.recorder
        t = time.time()
        for req in batch.reqs:
            if req is getattr(scheduler, "chunked_req", None):
                continue  # a middle chunk: the prompt is not complete yet
            logger.info("%s", record_line(TIMELINE_RECORD, {
                "rid": req.rid, "event": "prefill_done", "tokens": len(req.origin_input_ids),
                "t": round(t, 6)}))
            tr = Trace("timeline", getattr(req, "bootstrap_room", None) or 0)
            tr.mark("prefill_done", t)
            tr.facts.update(rid=req.rid, tokens=len(req.origin_input_ids))
            recorder.emit(tr)
        return None
