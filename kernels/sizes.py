"""Bytes each stream puts on the wire per token, from the codec parameters alone.

Used by reports and benchmarks (`lynx-sglang codec-report`, `bench-transfer`) that size transfers
for a model shape without encoding anything; `tests/kernels` checks it against real encodings.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import QUANT_BITS, CodecSpec, Target

SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero per group


@dataclass(frozen=True)
class StreamBytes:
    """Bytes per token for one layer's K and V together."""

    anchor: float
    residual: float

    @property
    def total(self) -> float:
        return self.anchor + self.residual


def stream_nbytes_per_token(spec: CodecSpec, num_kv_heads: int, head_dim: int,
                            dtype_bytes: int = 2, context_tokens: int | None = None) -> StreamBytes:
    """Average wire bytes per token per layer (K + V) of each stream.

    Groups are amortized over tokens (exact when the run length is a multiple of group_size).
    `dtype_bytes` is the KV dtype's size (the exact Residual and protected tokens are sent in it);
    protected sink/recent tokens are counted only when `context_tokens` is given.
    """
    hd = num_kv_heads * head_dim
    anchor = hd * spec.anchor_bits / 8 + SCALE_ZERO_BYTES * hd / spec.group_size
    if context_tokens:
        protected = min(spec.sink_tokens + spec.recent_tokens, context_tokens)
        anchor += protected * hd * dtype_bytes / context_tokens
    if spec.target is Target.EXACT:
        residual = hd * dtype_bytes
    else:
        residual = hd * (QUANT_BITS - spec.anchor_bits) / 8
    return StreamBytes(anchor=2 * anchor, residual=2 * residual)


def quantized_nbytes_per_token(bits: int, num_kv_heads: int, head_dim: int,
                               group_size: int = 64) -> float:
    """`bits`-bit KV (codes + fp16 scale/zero per group), K + V, per layer: INT4/INT2 baselines."""
    hd = num_kv_heads * head_dim
    return 2 * (hd * bits / 8 + SCALE_ZERO_BYTES * hd / group_size)
