"""Opt-in timeline log of a prefill server: one `lynx timeline {json}` line per request when its
prefill forward has finished (before SGLang hands its KV to the transfer backend).

Enabled by the plugin in scheduler processes when `LYNX_SGLANG_TIMELINE=1` (any transfer backend,
so the demo can compare `lynx` and `mooncake_tcp` on the same clock); read back by
`lynx_sglang.demo` with `prefill_done_events`. Times are wall-clock `time.time()` seconds, so they
compare with the client's and the decode's `lynx transfer` times on the same machine.
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger(__name__)

TIMELINE_ENV = "LYNX_SGLANG_TIMELINE"
PREFIX = "lynx timeline "


def enabled() -> bool:
    return os.environ.get(TIMELINE_ENV) == "1"


def prefill_done_before(scheduler, batch, result):
    """BEFORE hook on Scheduler.process_batch_result: log finished prefill forwards."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if scheduler.disaggregation_mode != DisaggregationMode.PREFILL:
        return None
    if not batch.forward_mode.is_extend():
        return None
    t = time.time()
    for req in batch.reqs:
        if req is getattr(scheduler, "chunked_req", None):
            continue  # a middle chunk: the prompt is not complete yet
        logger.info("%s%s", PREFIX, json.dumps({
            "rid": req.rid, "event": "prefill_done", "tokens": len(req.origin_input_ids),
            "t": round(t, 6)}))
    return None


def prefill_done_events(log_text: str) -> list[dict]:
    """The `prefill_done` events of a prefill server's log, in log order."""
    events = []
    for line in log_text.splitlines():
        i = line.find(PREFIX)
        if i >= 0:
            event = json.loads(line[i + len(PREFIX):])
            if event.get("event") == "prefill_done":
                events.append(event)
    return events
