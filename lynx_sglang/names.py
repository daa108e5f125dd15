"""Names the runtime writes and the tools and tests read: one place for each, so the writer and the
reader cannot drift apart.

- Structured log records: one line `<prefix><JSON object>` per event (`record_line` writes the
  text, `parse_records` reads every record of one kind back from a server log).
- Environment variables that carry settings into SGLang's spawned worker processes.
"""

from __future__ import annotations

import json

# Per-request record of the decode's transfer (bytes per stream, landed/applied times).
TRANSFER_RECORD = "lynx transfer "
# Per-request record of speculation (speculated / accepted / rolled back, verification time).
SPEC_RECORD = "lynx spec "
# A prefill server's "prefill forward done" event (LYNX_SGLANG_TIMELINE=1 only).
TIMELINE_RECORD = "lynx timeline "
# The launcher's line naming the effective Lynx configuration.
BACKEND_SELECTED = "lynx transfer backend selected: "

# The Lynx configuration as JSON (launcher -> SGLang's scheduler processes).
CONFIG_ENV = "LYNX_SGLANG_CONFIG"
# "1": prefill servers log TIMELINE_RECORD events (any transfer backend).
TIMELINE_ENV = "LYNX_SGLANG_TIMELINE"
# A directory for every server process's trace records (lynx_sglang.trace), any transfer
# backend; `--lynx-trace-dir` sets it for a Lynx server too.
TRACE_DIR_ENV = "LYNX_SGLANG_TRACE_DIR"
# "1": the schedulers of any transfer backend wait in SGLang's idle path (lynx_sglang.idle) as
# Lynx's do, instead of spinning while a transfer is in flight: a fair baseline on a box whose
# prefill and decode share the cores (benchmark variant `mooncake-nospin`).
IDLE_WAIT_ENV = "LYNX_SGLANG_IDLE_WAIT"
# Seconds: the longest a Lynx scheduler's idle wait sleeps when nothing wakes it (default
# lynx_sglang.idle.MAX_WAIT_S); new input and the backend's progress wake it sooner.
IDLE_MAX_WAIT_ENV = "LYNX_SGLANG_IDLE_MAX_WAIT_S"
# "1": a single server replaces prompt KV by its codec reconstruction on request (tests, studies).
REFERENCE_ENV = "LYNX_SGLANG_REFERENCE_KV"
# The shared secret of a deployment's Lynx transport sessions (alternative to --lynx-secret-file).
SECRET_ENV = "LYNX_SGLANG_SECRET"
# Tests only (prefill): seconds to hold a request's Residual back after its Anchor is finished
# (a windowed room's: its later segments, after the first).
FAULT_RESIDUAL_DELAY_ENV = "LYNX_SGLANG_FAULT_RESIDUAL_DELAY_S"
# Tests only (prefill): seconds to hold a request's Anchor back after the first half of its layers
# is written, so a fault can hit a request whose Anchor is part landed (phase mid-anchor).
FAULT_ANCHOR_DELAY_ENV = "LYNX_SGLANG_FAULT_ANCHOR_DELAY_S"
# Tests only (decode): seconds to hold the scheduler before each verification forward, so a fault
# can be injected while a verification is due (`lynx-sglang faults`, phase during-verification).
FAULT_VERIFY_DELAY_ENV = "LYNX_SGLANG_FAULT_VERIFY_DELAY_S"
# The prefill's and the decode's log lines when a fault-injection hold starts.
FAULT_RESIDUAL_HOLD_LOG = "Anchor finished; holding the Residual"  # windowed: the first segment
FAULT_ANCHOR_HOLD_LOG = "holding the rest of the Anchor"
# Logged by the decode for a room that found no free staging and waits for a range.
STAGING_QUEUED_LOG = "queued for staging"
FAULT_VERIFY_HOLD_LOG = "holding the verification"
# Logged by the decode when a speculating request is parked (taken out of the running batch, its
# KV kept) to wait for its Residual (`lynx-sglang faults`, phase parked).
SPEC_PARKED_LOG = "parked:"
# Logged by the decode for a room it announces in segments (it needs more staging than the pool).
WINDOWED_ROOM_LOG = "more than the pool"


def record_line(prefix: str, fields: dict) -> str:
    """The log text of one record (log it with `logger.info("%s", ...)`)."""
    return prefix + json.dumps(fields)


def parse_records(log_text: str, prefix: str) -> list[dict]:
    """Every `prefix{...}` record in `log_text`, in order. A prefix followed by anything but a
    JSON object (e.g. the launcher's plain-text lines) is not a record."""
    out = []
    for line in log_text.splitlines():
        i = line.find(prefix)
        if i < 0 or not line[i + len(prefix):].startswith("{"):
            continue
        out.append(json.loads(line[i + len(prefix):]))
    return out
