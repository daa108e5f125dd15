"""What a PD measurement reads back besides the client's own clock: the bytes the KV cache takes on
the wire, the decode's per-request `lynx transfer {json}` log lines (written by
`lynx_sglang.conn` when a request's Residual has been applied), the prefill's `prefill_done` event
of one client request (`lynx_sglang.timeline`), and a deadline-bounded wait for server log lines
that are written asynchronously.

Used by `lynx_sglang.demo` (one request per backend) and `lynx_sglang.bench_ttft` (several
requests per cluster variant). All times are wall-clock `time.time()` seconds on this machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The decode's per-request JSON line (not its "lynx transfer backend selected" start-up line).
TRANSFER_PREFIX = "lynx transfer {"
# The start-up line with the server's effective Lynx configuration.
CONFIG_PREFIX = "lynx transfer backend selected:"
# Lynx timeline points of the decode's `lynx transfer` line, in order.
LYNX_EVENTS = ("anchor_landed", "anchor_applied", "residual_landed", "residual_applied")


# KV pool dtypes a measurement can run with, and their bytes per value. The servers compute in fp32
# on CPU (bf16 matmuls are far slower there); `--kv-cache-dtype bfloat16` stores the KV as BF16,
# which is what a GPU deployment moves, so BF16 is the measurements' default.
KV_DTYPES = {"bfloat16": 2, "float32": 4}
DEFAULT_KV_DTYPE = "bfloat16"


def kv_dtype_server_args(kv_dtype: str) -> tuple[str, ...]:
    """The SGLang server flags that give the KV pool `kv_dtype` (float32 is the model's own)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
    return () if kv_dtype == "float32" else ("--kv-cache-dtype", kv_dtype)


def add_kv_dtype_argument(parser) -> None:
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default=DEFAULT_KV_DTYPE,
                        help="KV pool dtype of every server (SGLang --kv-cache-dtype; the model "
                             f"computes in fp32 either way; default {DEFAULT_KV_DTYPE}, what the "
                             "baseline then moves)")


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = KV_DTYPES[DEFAULT_KV_DTYPE]

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_model_dir(cls, model_dir: Path, kv_dtype: str = DEFAULT_KV_DTYPE) -> KVShape:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], cfg.get("num_key_value_heads",
                                                     cfg["num_attention_heads"]), head_dim,
                   KV_DTYPES[kv_dtype])


def selected_config(log_text: str) -> str | None:
    """The `LynxConfig(...)` a Lynx server logged at start-up (its effective `--lynx-*` flags)."""
    found = [ln[ln.index(CONFIG_PREFIX) + len(CONFIG_PREFIX):].strip()
             for ln in log_text.splitlines() if CONFIG_PREFIX in ln]
    return found[-1] if found else None


def transfer_lines(log_text: str) -> list[dict]:
    """Every `lynx transfer {json}` line of a decode server's log, in log order."""
    return [json.loads(ln[ln.index(TRANSFER_PREFIX) + len(TRANSFER_PREFIX) - 1:])
            for ln in log_text.splitlines() if TRANSFER_PREFIX in ln]


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
