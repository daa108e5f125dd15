"""The record of one verification (`log_verification`): the request's `spec` trace record, the
speculation counters, the verification metric and the `SPEC_RECORD` log line that the tools
(`lynx-sglang bench-ttft`, the demo, the fault matrix) parse. Called by
`speculation.controller.SpecController` after each verification forward, with the process's
recorder (`recorder.Recorder`) that the record and the metrics go to."""

from __future__ import annotations

import logging
import time

from ..names import SPEC_RECORD, record_line
from ..recorder import Recorder
from ..trace import Trace
from .state import SpecCounters, SpecState, VerifyResult

logger = logging.getLogger(__name__)


def log_verification(recorder: Recorder, c: SpecCounters, req, st: SpecState,
                     result: VerifyResult, verify_s: float, model_passes: int, batch_size: int,
                     verify_start: float | None) -> None:
    """What one request's verification leaves behind: its `spec` trace record, the counters `c`
    (the controller's), the verification metric and the SPEC_RECORD log line the tools parse."""
    tr = Trace("spec", st.room)
    if verify_start is not None:
        tr.mark("verify_start", verify_start)
        tr.mark("verify_end", verify_start + verify_s)
    tr.facts.update(rid=req.rid, speculated=result.speculated, accepted=result.accepted,
                    no_spec_reason=st.no_spec_reason, parked_reason=st.parked_reason,
                    verify_batch=batch_size)
    recorder.emit(tr)
    c.verifications += 1
    c.speculated_tokens += result.speculated
    c.accepted_tokens += result.accepted
    c.rolled_back_tokens += result.speculated - result.accepted
    recorder.metrics.record_verification(result.speculated, result.accepted,
                                "not_speculable" if st.no_spec_reason else "verified")
    now = time.monotonic()
    logger.info("%s", record_line(SPEC_RECORD, {
        "t": round(time.time(), 6), "rid": req.rid, "room": st.room, "speculated": result.speculated,
        "accepted": result.accepted, "rolled_back": result.speculated - result.accepted,
        "corrected": result.corrected_token is not None,
        "bonus": result.bonus_token is not None,
        "no_spec_reason": st.no_spec_reason, "parked_reason": st.parked_reason,
        "verify_ms": round(verify_s * 1e3, 3), "verify_model_passes": model_passes,
        "verify_batch": batch_size,
        "committed_to_verified_s": round(now - st.t_committed, 6),
        "parked_s": None if st.t_parked is None else round(now - st.t_parked, 6),
        "totals": {"verifications": c.verifications, "speculated": c.speculated_tokens,
                   "accepted": c.accepted_tokens, "rolled_back": c.rolled_back_tokens,
                   "verify_forwards": c.verify_forwards,
                   "verify_model_passes": c.verify_model_passes}}))
