"""`StreamPlan`: the byte layout of one request's two streams, computed once from what both ends
know before anything is encoded (codec settings, KV shape, token count, chunk size).

With `--lynx-anchor-width adaptive` the prefill picks the Anchor's width per request
(`backend.prefill.anchor_width`) after the decode has announced its staging, so both ends build one plan
per width the decode accepts (`StreamPlan.for_widths`): every plan of the set has the same extents
(each layer's widest Anchor and Residual over the widths), which is what staging and the
announcement hold; the Anchor and Residual of the width picked lie in their extents' first bytes.
The decode learns the width from the first Anchor chunk's header (`backend.decode.apply`).

Stream layout: for layer 0..L-1, for each kind the pool holds (K then V; an MLA pool's latent
alone, `backend.pool`), the wire chunks of tokens [0, T) cut every `chunk_tokens` tokens
(`lynx_kernels.fused.run_nbytes`), concatenated. Every layer's share of the Anchor
stream has the same length, so layer l's Anchor lies at `anchor_offset(l)`. The Residual's layers
also follow one another, but an exact Residual is coded, so its size depends on the values: the
plan gives each layer's bound (`residual_layer_bytes`), and the decode finds the layers by walking
the self-describing chunks. A request's staging range holds the Anchor stream then room for the
Residual stream's bound (`staging_bytes`). The decode sizes and announces its staging range from the plan
(`backend.decode.applier`), the prefill checks the announcement against its own plan and writes each layer
at the plan's offsets (`backend.prefill.writer`), and the decode parses the landed streams with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from lynx_kernels import CodecSpec, KVShape, StreamKind, WireStream, fused
from lynx_kernels.sizes import stream_nbytes_per_token

from ..config import LynxConfig
from ..errors import KVStreamError
from .pool import KINDS, PoolShape
from .staging import ALIGN

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamPlan:
    num_tokens: int
    num_layers: int
    chunk_tokens: int
    # Per layer, per kind of `kinds` (K then V, or the MLA latent alone): the run's bytes
    # (Anchor exactly; Residual its bound).
    anchor_run_bytes: tuple[int, ...]
    residual_run_bound: tuple[int, ...]
    # The Residual's expected size: its bound for the fixed-size int8 format; for the coded
    # exact one the estimate from corrections measured on real KV (`lynx_kernels.sizes`).
    residual_bytes_expected: int
    kinds: tuple[StreamKind, ...] = KINDS
    # The Anchor's width (`CodecSpec.anchor_bits`) this plan lays out.
    anchor_bits: int = 4
    # Per layer, the room staging and the announcement hold for each stream: this plan's own
    # sizes, or the largest of a set of widths (`for_widths`). 0: this plan's own.
    anchor_layer_extent: int = 0
    residual_layer_extent: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "anchor_layer_extent",
                           max(self.anchor_layer_extent, self.anchor_layer_bytes))
        object.__setattr__(self, "residual_layer_extent",
                           max(self.residual_layer_extent, self.residual_layer_bytes))

    @classmethod
    def for_widths(cls, specs: list[CodecSpec], shape: KVShape, num_tokens: int,
                   chunk_tokens: int) -> dict[int, StreamPlan]:
        """One plan per spec of `specs` (codecs that differ in their Anchor width only), by that
        width, all with the same extents: the largest of each stream's layer over the widths."""
        plans = {s.anchor_bits: cls.build(s, shape, num_tokens, chunk_tokens) for s in specs}
        anchor = max(p.anchor_layer_bytes for p in plans.values())
        residual = max(p.residual_layer_bytes for p in plans.values())
        return {w: replace(p, anchor_layer_extent=anchor, residual_layer_extent=residual)
                for w, p in plans.items()}

    @classmethod
    def build(cls, spec: CodecSpec, shape: KVShape, num_tokens: int,
              chunk_tokens: int) -> StreamPlan:
        if num_tokens <= 0:
            raise KVStreamError(f"a request must have at least one token, got {num_tokens}")
        # A shape read off a live pool says which kinds it holds; any other is MHA's K and V.
        kinds = shape.kinds if isinstance(shape, PoolShape) else KINDS
        runs = [fused.run_nbytes(spec, kind, shape.dtype, shape.num_kv_heads, shape.head_dim,
                                 num_tokens, chunk_tokens) for kind in kinds]
        bound = shape.num_layers * sum(run.residual_bound for run in runs)
        per_token = stream_nbytes_per_token(spec, shape.num_kv_heads, shape.head_dim,
                                            shape.dtype.itemsize, num_tokens, dtype=shape.dtype)
        # `per_token` counts K and V; a pool may hold one kind.
        values = shape.num_layers * num_tokens * len(kinds) / len(KINDS)
        headers = max(bound - round(values * per_token.residual), 0)
        expected = min(bound, round(values * per_token.residual_expected) + headers)
        return cls(num_tokens, shape.num_layers, chunk_tokens,
                   tuple(run.anchor for run in runs),
                   tuple(run.residual_bound for run in runs), expected, kinds, spec.anchor_bits)

    @property
    def anchor_layer_bytes(self) -> int:
        return sum(self.anchor_run_bytes)

    @property
    def residual_layer_bytes(self) -> int:
        """A layer's Residual bound (its exact size for the int8 target)."""
        return sum(self.residual_run_bound)

    @property
    def anchor_bytes(self) -> int:
        return self.num_layers * self.anchor_layer_bytes

    @property
    def residual_bytes(self) -> int:
        return self.num_layers * self.residual_layer_bytes

    @property
    def anchor_extent(self) -> int:
        """The Anchor stream's room in staging and the announcement (>= `anchor_bytes`)."""
        return self.num_layers * self.anchor_layer_extent

    @property
    def residual_extent(self) -> int:
        """The Residual stream's room (>= its bound `residual_bytes`)."""
        return self.num_layers * self.residual_layer_extent

    @property
    def staging_bytes(self) -> int:
        """The Anchor's extent then the Residual's, back to back."""
        return self.anchor_extent + self.residual_extent

    def stream_bytes(self, stream: WireStream) -> int:
        return self.anchor_bytes if stream is WireStream.ANCHOR else self.residual_bytes

    def stream_extent(self, stream: WireStream) -> int:
        """What the decode announces for `stream`."""
        return self.anchor_extent if stream is WireStream.ANCHOR else self.residual_extent

    def anchor_offset(self, layer: int) -> int:
        """Where layer `layer`'s Anchor chunks start in the Anchor stream (and in staging)."""
        return layer * self.anchor_layer_bytes


def room_plans(config: LynxConfig, shape: KVShape, num_tokens: int) -> dict[int, StreamPlan]:
    """A request's plans by Anchor width, one per width `config` allows (`LynxConfig.anchor_widths`),
    with shared extents (`StreamPlan.for_widths`)."""
    return StreamPlan.for_widths([config.codec_for(w) for w in config.anchor_widths()], shape,
                                 num_tokens, config.chunk_tokens)


def windowed_plan(config: LynxConfig, shape: KVShape, num_tokens: int) -> StreamPlan:
    """The plan of a request sent in segments through staging windows (`backend.window`): the
    configured Anchor width whatever `--lynx-anchor-width` (a window holds fixed layouts), so
    both ends build it alike (decode admission, the prefill's destination worker)."""
    return StreamPlan.build(config.codec, shape, num_tokens, config.chunk_tokens)


def max_tokens_in_staging(config: LynxConfig, shape: KVShape, staging_bytes: int, align: int,
                          upper: int) -> int:
    """The longest request (at most `upper` tokens) whose staging range, rounded up to `align`
    bytes as the staging pool allocates it, fits in `staging_bytes` (0 if none does). A request
    holds its range whole, so a longer one fails (`StagingFullError`) however idle the server."""
    def fits(n: int) -> bool:
        need = room_plans(config, shape, n)[config.codec.anchor_bits].staging_bytes
        return -(-need // align) * align <= staging_bytes

    lo, hi = 0, upper  # fits(lo) or lo == 0; the staging range grows with the token count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def log_staging_fit(lynx: LynxConfig, shape: KVShape, staging_bytes: int, longest: int) -> None:
    """Log how long a request `staging_bytes` of staging hold whole, against the `longest` this
    server takes: a longer one is sent in segments through windows of staging
    (`backend.window`), slower and without speculation. Called by the manager at start-up."""
    fit = max_tokens_in_staging(lynx, shape, staging_bytes, ALIGN, longest)
    if fit >= longest:
        logger.info("lynx: --lynx-staging-mib %d holds a request of up to %d tokens, the "
                    "longest this server takes", lynx.staging_mib, longest)
        return
    need = room_plans(lynx, shape, longest)[lynx.codec.anchor_bits]
    logger.warning(
        "lynx: --lynx-staging-mib %d holds a request of up to %d tokens whole (target %s); "
        "this server takes up to %d, and a longer request is sent in segments through "
        "windows of staging, without speculation: --lynx-staging-mib %d would hold one "
        "whole (on prefill and decode)",
        lynx.staging_mib, fit, lynx.codec.target.value, longest,
        -(-need.staging_bytes // (1 << 20)))
