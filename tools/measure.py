"""Helpers of a PD measurement besides the client's own clock: the KV pool dtype the servers run
with (and so the bytes the baseline moves), a deadline-bounded wait for records that servers
write asynchronously, and readers of the decode's per-request log records (the end-to-end tests
check those lines; the tools read the structured trace, `tools.trace_report`). Record prefixes come
from `lynx_sglang.names`, the same constants the servers write with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from lynx_kernels import KVShape
from lynx_sglang.names import SPEC_RECORD, TRANSFER_RECORD, parse_records

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


def add_kv_dtype_argument(parser, default: str | None = DEFAULT_KV_DTYPE) -> None:
    """`default` None: the caller fills it in after parsing (and can tell whether it was given)."""
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default=default,
                        help="KV pool dtype of every server (SGLang --kv-cache-dtype; the model "
                             f"computes in fp32 either way; default {DEFAULT_KV_DTYPE}, what the "
                             "baseline then moves)")


def model_kv_shape(model_dir: Path, kv_dtype: str = DEFAULT_KV_DTYPE) -> KVShape:
    """The KV shape of the model in `model_dir` with a `kv_dtype` pool."""
    return KVShape.from_hf_config(model_dir, kv_dtype)


def transfer_lines(log_text: str) -> list[dict]:
    """Every transfer record of a decode server's log, in log order."""
    return parse_records(log_text, TRANSFER_RECORD)


def spec_lines(log_text: str) -> list[dict]:
    """Every speculation record of a decode server's log, in log order."""
    return parse_records(log_text, SPEC_RECORD)


def wait_for(ready: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.2) -> bool:
    """Poll `ready` until it is true or `timeout_s` has passed (servers log asynchronously, so a
    line may reach its file a moment after the client got its answer). Returns the last result."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def metric_samples(metrics_url: str, name: str, timeout_s: float = 30.0) -> list | None:
    """The samples named `name` on a server's Prometheus `/metrics` page; None when the page
    cannot be read (an empty list when it has no such sample)."""
    try:
        r = requests.get(f"{metrics_url.rstrip('/')}/metrics", timeout=timeout_s)
    except requests.RequestException:
        return None
    if r.status_code != 200:
        return None
    return [sample for family in text_string_to_metric_families(r.text)
            for sample in family.samples if sample.name == name]


def metric_sum(metrics_url: str, name: str, timeout_s: float = 10.0) -> float | None:
    """The sum of a server's samples of `name`; None if the page cannot be read or has none, so
    that a leak check which read nothing cannot pass."""
    samples = metric_samples(metrics_url, name, timeout_s)
    return sum(sample.value for sample in samples) if samples else None


def all_zero(values: dict[str, float | None]) -> bool:
    """Every value read and 0 (`metric_sum` per server)."""
    return all(v == 0 for v in values.values())
