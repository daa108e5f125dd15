"""Bytes each stream puts on the wire per token, from the codec parameters alone.

Used by reports and benchmarks (`lynx-sglang codec-report`, `bench-transfer`) that size transfers
for a model shape without encoding anything; `tests/kernels` checks it against real encodings.
The exact Residual's size depends on the data: `residual` is its bound (what staging must hold),
`residual_expected` an estimate from corrections measured on real KV (`EXACT_CORRECTION_BITS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import QUANT_BITS, CodecSpec, Target

SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero per group

# Estimate (not a bound): bits per coded value of the exact Residual's correction section, record
# lengths included, measured on SmolLM2-135M K and V (rotate on, group 64, chunks of 256 tokens;
# K and V averaged); see docs/codec.md. Real data may need more or fewer.
EXACT_CORRECTION_BITS = {torch.bfloat16: 3.1, torch.float16: 6.0, torch.float32: 19.0}


@dataclass(frozen=True)
class StreamBytes:
    """Bytes per token for one layer's K and V together (payloads, no chunk headers)."""

    anchor: float
    residual: float
    residual_expected: float

    @property
    def total(self) -> float:
        """Anchor + the Residual's bound."""
        return self.anchor + self.residual

    @property
    def expected_total(self) -> float:
        return self.anchor + self.residual_expected


def stream_nbytes_per_token(spec: CodecSpec, num_kv_heads: int, head_dim: int,
                            dtype_bytes: int = 2, context_tokens: int | None = None, *,
                            dtype: torch.dtype | None = None) -> StreamBytes:
    """Average wire bytes per token per layer (K + V) of each stream.

    Groups are amortized over tokens (exact when the run length is a multiple of group_size).
    `dtype_bytes` is the KV dtype's size (protected tokens and the exact Residual's bound are in
    it); `dtype` picks the exact Residual's estimate (default: bf16 for 2 bytes, fp32 for 4).
    Protected sink/recent tokens are counted only when `context_tokens` is given.
    """
    hd = num_kv_heads * head_dim
    anchor = hd * spec.anchor_bits / 8 + SCALE_ZERO_BYTES * hd / spec.group_size
    coded = 1.0
    if context_tokens:
        protected = min(spec.sink_tokens + spec.recent_tokens, context_tokens)
        anchor += protected * hd * dtype_bytes / context_tokens
        coded = 1 - protected / context_tokens
    low_bits = hd * (QUANT_BITS - spec.anchor_bits) / 8
    if spec.target is Target.EXACT:
        dtype = dtype or (torch.float32 if dtype_bytes == 4 else torch.bfloat16)
        residual = hd * dtype_bytes
        expected = min(residual, low_bits + coded * hd * EXACT_CORRECTION_BITS[dtype] / 8)
    else:
        residual = expected = low_bits
    return StreamBytes(anchor=2 * anchor, residual=2 * residual, residual_expected=2 * expected)


def quantized_nbytes_per_token(bits: int, num_kv_heads: int, head_dim: int,
                               group_size: int = 64) -> float:
    """`bits`-bit KV (codes + fp16 scale/zero per group), K + V, per layer: INT4/INT2 baselines."""
    hd = num_kv_heads * head_dim
    return 2 * (hd * bits / 8 + SCALE_ZERO_BYTES * hd / group_size)
