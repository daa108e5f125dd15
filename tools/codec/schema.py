"""The codec report's schema (`lynx-sglang codec-report`): the dataclasses `lynx_tools.codec.measure`
fills and `lynx_tools.codec.report` prints and writes as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WireBytes:
    """Bytes per token for the whole model (all layers) of one kind (or K+V), or the same as ratios
    to the BF16 bytes. anchor/residual/total: the wire streams, chunk headers included. ideal
    (target exact only): the Anchor + the Residual's low bits + H(c | class) of the corrections."""

    anchor: float
    residual: float
    total: float
    ideal: float | None = None


@dataclass(frozen=True)
class ErrorStats:
    """Reconstruction error of one stage over all sampled values (K and V)."""

    relative_rmse: float  # rms(error) / rms(value)
    snr_db: float | None  # None: no error at all (infinite)
    max_abs_error: float
    cosine_similarity: float  # mean over (token, head) rows


@dataclass(frozen=True)
class TargetReport:
    """One target: `bytes_per_token` and `ratio_to_bf16` keyed "k", "v", "k+v"."""

    target: str
    spec: dict
    bytes_per_token: dict[str, WireBytes]
    ratio_to_bf16: dict[str, WireBytes]
    anchor_error: ErrorStats
    full_error: ErrorStats
    # target exact: bits per coded (non-protected) value the Residual spends beyond its low bits
    # (k tables, record lengths, records; chunk headers excluded), and the entropy H(c | class)
    # of the corrections, keyed "k", "v", "k+v" (K+V: H(c | kind, class); None for int8).
    correction_bits_per_value: dict[str, float] | None = None
    entropy_bits_per_value: dict[str, float] | None = None
    raw_chunks: int = 0  # exact Residual chunks sent as raw values (coded form was longer)
    bit_identical: bool | None = None  # target exact: full decode == the KV bit for bit


@dataclass(frozen=True)
class Report:
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    kv: str  # "real" | "synthetic"
    kv_description: str  # what the sample KV is, as printed
    sequence_tokens: list[int]  # tokens of each sequence (prompt) encoded
    layers_measured: int  # layers of each sequence encoded (bytes are scaled to `layers`)
    chunk_tokens: int
    reference_bytes_per_token: dict[str, float]  # bf16, int8, int4 KV, whole model
    reference_ratio_to_bf16: dict[str, float]
    targets: list[TargetReport] = field(default_factory=list)
