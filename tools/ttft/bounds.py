"""What each variant's TTFT from the send could be at best on one regime's link: its byte bound
(`byte_bounds`), the yardstick of issue 44's goals ("within 10 % of its byte bound").

A variant's first token waits for the forward F and for the bytes it needs before decoding
(`gating_bytes`): the whole KV for a full-KV transfer (mooncake), the Anchor for a speculative
Lynx variant or the Anchor alone (int4-anchor), Anchor and Residual for a non-speculative one.
Sent after the forward those bytes add their whole wire time W; layer-streamed they can go while
the forward computes, so at best the first token comes at max(F, W). Every variant also pays
what a transfer costs beyond forward and wire (bootstrap, the first decode step, the client):
taken as the baseline's own, its median TTFT - F - its W (`fixed_s`), so that the baseline's
bound is its own median. F is the regime's measured forward (send -> forward done of the
baseline's requests). Used by `regime` (report and JSON).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .results import LYNX_CLIENT, VariantResult, metric_values


@dataclass(frozen=True)
class Bound:
    gating_bytes: int
    wire_s: float  # the gating bytes' wire time at the regime's rate
    streamed: bool  # whether the bound lets them cross during the forward
    bound_s: float  # max(F, W) or F + W, plus the fixed cost
    ttft_s: float | None  # the variant's median TTFT from the send (lynx client)

    @property
    def ratio(self) -> float | None:
        """Measured ÷ bound (1: at the bound)."""
        return None if self.ttft_s is None else self.ttft_s / self.bound_s


def gating_bytes(result: VariantResult) -> int | None:
    """Bytes a variant's first token waits for (None: unknown)."""
    b = result.stream_bytes
    if "kv" in b:
        return b["kv"]
    if "anchor" not in b:
        return None
    args = result.variant.server_args
    speculative = "--no-lynx-speculate" not in args
    return b["anchor"] if speculative else b["anchor"] + b.get("residual", 0)


def _streams(result: VariantResult) -> bool:
    return (result.variant.transfer_backend == "lynx"
            and "--no-lynx-layer-stream" not in result.variant.server_args)


def _median_ttft(result: VariantResult) -> float | None:
    values = metric_values(result.requests, ()).get(f"{LYNX_CLIENT}.ttft_s")
    return statistics.median(values) if values else None


def byte_bounds(results: list[VariantResult], baseline: str, forward_s: float | None,
                link_bps: float) -> dict[str, Bound]:
    """Each variant's byte bound at `link_bps` with forward `forward_s` (empty where the forward,
    the baseline's TTFT or its bytes are unknown)."""
    base = next((r for r in results if r.variant.name == baseline), None)
    if base is None or not forward_s or link_bps <= 0:
        return {}
    base_bytes, base_ttft = gating_bytes(base), _median_ttft(base)
    if base_bytes is None or base_ttft is None:
        return {}
    base_wire = base_bytes * 8 / link_bps
    base_floor = max(forward_s, base_wire) if _streams(base) else forward_s + base_wire
    fixed_s = base_ttft - base_floor
    out = {}
    for r in results:
        nbytes = gating_bytes(r)
        if nbytes is None:
            continue
        wire = nbytes * 8 / link_bps
        streamed = _streams(r)
        floor = max(forward_s, wire) if streamed else forward_s + wire
        out[r.variant.name] = Bound(nbytes, wire, streamed, floor + fixed_s, _median_ttft(r))
    return out
