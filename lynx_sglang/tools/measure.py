"""What a PD measurement reads back besides the client's own clock: the bytes the KV cache takes on
the wire, the decode's per-request transfer and speculation records, the prefill's
`prefill_done` event of one client request (`lynx_sglang.timeline`), and a deadline-bounded wait
for server log records that are written asynchronously. Record prefixes come from
`lynx_sglang.names`, the same constants the servers write with.

Used by `tools.demo` (one request per variant) and `tools.bench_ttft` (several requests per
cluster variant). All times are wall-clock `time.time()` seconds on this machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from lynx_kernels import KVShape

from ..names import (
    BACKEND_SELECTED,
    SPEC_RECORD,
    TIMELINE_RECORD,
    TRANSFER_RECORD,
    parse_records,
)

# Lynx timeline points of the decode's transfer record, in order.
LYNX_EVENTS = ("anchor_landed", "anchor_applied", "residual_landed", "residual_applied")

# KV pool dtypes a measurement can run with. The servers compute in fp32 on CPU (bf16 matmuls are
# far slower there); `--kv-cache-dtype bfloat16` stores the KV as BF16, which is what a GPU
# deployment moves, so BF16 is the measurements' default.
KV_DTYPES = ("bfloat16", "float32")
DEFAULT_KV_DTYPE = "bfloat16"


def kv_dtype_server_args(kv_dtype: str) -> tuple[str, ...]:
    """The SGLang server flags that give the KV pool `kv_dtype` (float32 is the model's own)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return () if kv_dtype == "float32" else ("--kv-cache-dtype", kv_dtype)


def add_kv_dtype_argument(parser) -> None:
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=DEFAULT_KV_DTYPE,
                        help="KV pool dtype of every server (SGLang --kv-cache-dtype; the model "
                             f"computes in fp32 either way; default {DEFAULT_KV_DTYPE}, what the "
                             "baseline then moves)")


def model_kv_shape(model_dir: Path, kv_dtype: str = DEFAULT_KV_DTYPE) -> KVShape:
    """The KV shape of the model in `model_dir` with a `kv_dtype` pool."""
    return KVShape.from_hf_config(model_dir, kv_dtype)


def selected_config(log_text: str) -> str | None:
    """The `LynxConfig(...)` a Lynx server logged at start-up (its effective `--lynx-*` flags)."""
    found = [ln[ln.index(BACKEND_SELECTED) + len(BACKEND_SELECTED):].strip()
             for ln in log_text.splitlines() if BACKEND_SELECTED in ln]
    return found[-1] if found else None


def transfer_lines(log_text: str) -> list[dict]:
    """Every transfer record of a decode server's log, in log order."""
    return parse_records(log_text, TRANSFER_RECORD)


def spec_lines(log_text: str) -> list[dict]:
    """Every speculation record of a decode server's log, in log order."""
    return parse_records(log_text, SPEC_RECORD)


def prefill_done_events(log_text: str) -> list[dict]:
    """The `prefill_done` events of a prefill server's log, in log order."""
    return [e for e in parse_records(log_text, TIMELINE_RECORD) if e.get("event") == "prefill_done"]


def transfer_line_for(lines: list[dict], tokens: int, t_from: float,
                      t_to: float) -> dict | None:
    """The transfer line of the `tokens`-token request announced in [t_from, t_to) (one client
    request at a time: its send, the next request's send)."""
    found = [ln for ln in lines
             if ln["tokens"] == tokens and ln.get("announced") is not None
             and t_from <= ln["announced"] < t_to]
    return found[-1] if found else None


def prefill_done_for(events: list[dict], tokens: int, t_send: float,
                     t_first_token: float) -> dict | None:
    """The `prefill_done` event of the `tokens`-token request sent at `t_send` whose first token
    arrived at `t_first_token` (requests sent one at a time)."""
    found = [e for e in events if e["tokens"] == tokens and t_send <= e["t"] <= t_first_token]
    return found[-1] if found else None


def wait_for(ready: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.2) -> bool:
    """Poll `ready` until it is true or `timeout_s` has passed (servers log asynchronously, so a
    line may reach its file a moment after the client got its answer). Returns the last result."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
