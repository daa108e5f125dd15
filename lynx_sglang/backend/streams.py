"""How one request's KV cache becomes the two Lynx byte streams, and back into a KV pool.

The layout of the streams is the request's `StreamPlan` (`backend.plan`). Chunks are
self-describing (`lynx_kernels.parse_chunk`), so the decode walks a landed stream chunk by chunk.
Prefill reads a request's slots (`encode_layer_into` for every layer's Anchor, then
`write_residual_into`, straight into staging; `encode_layer` makes the same chunks as `bytes`);
decode writes the Anchor reconstruction into its own slots (`parse_anchor` + `write_anchor`, or
`apply_anchor`) and overwrites the same slots with the full-precision values when the Residual has
landed (`apply_residual`).

Called by `backend.prefill` (sender thread) and `backend.decode` (applier thread).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from lynx_kernels import (
    Chunk,
    ChunkHeader,
    CodecError,
    CodecSpec,
    EncodedKV,
    KVShape,
    StreamKind,
    Target,
    WireStream,
    assemble,
    decode,
    encode,
    parse_chunk,
    to_chunks,
    write_chunks,
)
from lynx_kernels.wire import HEADER

from ..errors import KVStreamError
from .pool import KINDS, KVPoolView


def encode_layer(pool: KVPoolView, layer: int, slots: torch.Tensor, spec: CodecSpec,
                 chunk_tokens: int, request_tag: int) -> tuple[list[bytes], list[bytes]]:
    """Anchor and Residual chunks of one layer (K then V) of the tokens held in `slots`, as new
    `bytes` (`encode_layer_into` writes the same bytes straight into a buffer)."""
    anchors: list[bytes] = []
    residuals: list[bytes] = []
    for kind in KINDS:
        enc = encode(pool.read(layer, kind, slots), spec, kind.value, layer=layer)
        anchors += to_chunks(enc, chunk_tokens, stream="anchor", request_tag=request_tag)
        residuals += to_chunks(enc, chunk_tokens, stream="residual", request_tag=request_tag)
    return anchors, residuals


@dataclass
class LayerEncoding:
    """One layer's K and V encodings between its Anchor write and its Residual write. Exact
    Residuals (the values themselves) are not kept: the pool slots still hold them."""

    layer: int
    runs: tuple[EncodedKV, EncodedKV]


def encode_layer_into(pool: KVPoolView, layer: int, slots: torch.Tensor, spec: CodecSpec,
                      chunk_tokens: int, request_tag: int, anchor_out) -> tuple[int, LayerEncoding]:
    """`encode_layer`'s Anchor chunks written back to back into the writable buffer `anchor_out`
    (a staging range: no intermediate `bytes`); returns the bytes written and what
    `write_residual_into` needs for the layer's Residual chunks, so every layer's Anchor can go
    out before any Residual is written. Every layer's share of a stream has the same length, so
    layer l's lies at l * that length (`stream_nbytes` / num_layers)."""
    written = 0
    runs = []
    for kind in KINDS:
        enc = encode(pool.read(layer, kind, slots), spec, kind.value, layer=layer)
        written += sum(write_chunks(enc, chunk_tokens, anchor_out[written:], stream="anchor",
                                    request_tag=request_tag))
        runs.append(replace(enc, residual=None) if spec.target is Target.EXACT else enc)
    return written, LayerEncoding(layer, (runs[0], runs[1]))


def write_residual_into(pool: KVPoolView, encoded: LayerEncoding, slots: torch.Tensor,
                        chunk_tokens: int, request_tag: int, residual_out) -> int:
    """The layer's Residual chunks (K then V) written back to back into `residual_out`; returns
    the bytes written. `slots` must still hold the values `encode_layer_into` encoded."""
    written = 0
    for kind, enc in zip(KINDS, encoded.runs, strict=True):
        if enc.residual is None:  # exact: the Residual is the values
            enc = replace(enc, residual=pool.read(encoded.layer, kind, slots))
        written += sum(write_chunks(enc, chunk_tokens, residual_out[written:], stream="residual",
                                    request_tag=request_tag))
    return written


def iter_chunks(stream_bytes: memoryview) -> Iterator[Chunk]:
    """Parse a landed stream chunk by chunk (each validated: header, lengths, CRC)."""
    pos = 0
    n = len(stream_bytes)
    while pos < n:
        if n - pos < HEADER.size:
            raise KVStreamError(f"stream ends inside a chunk header at byte {pos} of {n}")
        payload_len = HEADER.unpack(stream_bytes[pos: pos + HEADER.size])[-2]
        end = pos + HEADER.size + payload_len
        if end > n:
            raise KVStreamError(f"chunk at byte {pos} runs past the stream end ({end} > {n})")
        yield parse_chunk(stream_bytes[pos:end])
        pos = end


def _check_header(h: ChunkHeader, spec: CodecSpec, shape: KVShape, num_tokens: int,
                  request_tag: int, stream: WireStream) -> None:
    if h.stream is not stream:
        raise KVStreamError(f"expected a {stream.name} chunk, got {h.stream.name}")
    if h.request_tag != request_tag:
        raise KVStreamError(f"chunk of request {h.request_tag} in the stream of {request_tag}")
    if h.spec != spec:
        raise KVStreamError(f"prefill codec settings {h.spec} differ from this decode's {spec}; "
                            "set the same --lynx-* flags on both servers")
    if (h.num_heads, h.head_dim, h.dtype) != (shape.num_kv_heads, shape.head_dim, shape.dtype):
        raise KVStreamError(
            f"chunk shape heads={h.num_heads} head_dim={h.head_dim} {h.dtype} does not match the "
            f"decode KV pool ({shape.num_kv_heads}, {shape.head_dim}, {shape.dtype})"
        )
    if not 0 <= h.layer < shape.num_layers or h.total_tokens != num_tokens:
        raise KVStreamError(f"chunk layer {h.layer} / {h.total_tokens} tokens does not fit a "
                            f"{shape.num_layers}-layer request of {num_tokens} tokens")


def parse_anchor(stream_bytes: memoryview, pool: KVPoolView, num_tokens: int,
                 spec: CodecSpec, request_tag: int) -> dict[tuple[int, StreamKind, int], Chunk]:
    """Validate a landed Anchor stream (every chunk, and that the chunks tile every layer's K and
    V over [0, num_tokens)); return its chunks keyed by (layer, kind, token_start)."""
    shape = pool.shape
    chunks: dict[tuple[int, StreamKind, int], Chunk] = {}
    for chunk in iter_chunks(stream_bytes):
        h = chunk.header
        _check_header(h, spec, shape, num_tokens, request_tag, WireStream.ANCHOR)
        chunks[(h.layer, h.kind, h.token_start)] = chunk
    _check_coverage(chunks, shape, num_tokens)
    return chunks


def _runs(chunks: dict[tuple[int, StreamKind, int], Chunk]) -> dict[tuple[int, StreamKind],
                                                                    list[Chunk]]:
    """The chunks of each (layer, kind), in token order."""
    runs: dict[tuple[int, StreamKind], list[Chunk]] = {}
    for key in sorted(chunks, key=lambda k: (k[0], KINDS.index(k[1]), k[2])):
        runs.setdefault(key[:2], []).append(chunks[key])
    return runs


def _write_run(pool: KVPoolView, layer: int, kind: StreamKind, slots: torch.Tensor,
               chunks: list[Chunk], stage: str) -> None:
    # One decode and one indexed write per layer's K or V: the codec's per-call cost, not per
    # chunk. The values are the same as chunk by chunk (every step is per token or per group).
    try:
        enc = assemble(chunks, device=pool.device)
    except CodecError as exc:
        raise KVStreamError(str(exc)) from exc
    pool.write(layer, kind, slots[enc.token_start: enc.token_end], decode(enc, stage))


def write_anchor(anchors: dict[tuple[int, StreamKind, int], Chunk], pool: KVPoolView,
                 slots: torch.Tensor) -> None:
    """Write the Anchor reconstruction of every chunk into the decode pool's `slots`."""
    for (layer, kind), run in _runs(anchors).items():
        _write_run(pool, layer, kind, slots, run, "anchor")


def apply_anchor(stream_bytes: memoryview, pool: KVPoolView, slots: torch.Tensor,
                 spec: CodecSpec, request_tag: int) -> dict[tuple[int, StreamKind, int], Chunk]:
    """`parse_anchor` then `write_anchor`; returns the parsed chunks for `apply_residual`."""
    anchors = parse_anchor(stream_bytes, pool, len(slots), spec, request_tag)
    write_anchor(anchors, pool, slots)
    return anchors


def apply_residual(stream_bytes: memoryview, anchors: dict[tuple[int, StreamKind, int], Chunk],
                   pool: KVPoolView, slots: torch.Tensor, spec: CodecSpec,
                   request_tag: int) -> None:
    """Overwrite the Anchor-precision values in `slots` with the full-precision ones."""
    shape = pool.shape
    num_tokens = len(slots)
    residuals: dict[tuple[int, StreamKind, int], Chunk] = {}
    for chunk in iter_chunks(stream_bytes):
        h = chunk.header
        _check_header(h, spec, shape, num_tokens, request_tag, WireStream.RESIDUAL)
        key = (h.layer, h.kind, h.token_start)
        anchor = anchors.get(key)
        if anchor is None or anchor.header.token_end != h.token_end:
            raise KVStreamError(f"Residual chunk layer {h.layer} {h.kind.value} tokens "
                                f"[{h.token_start}, {h.token_end}) has no matching Anchor chunk")
        residuals[key] = chunk
    if residuals.keys() != anchors.keys():
        missing = sorted(set(anchors) - set(residuals))[:3]
        raise KVStreamError(f"Residual stream misses {len(anchors) - len(residuals)} chunks "
                            f"(e.g. {missing})")
    # Nothing is written until the whole Residual stream has checked out.
    runs = _runs(residuals)
    for (layer, kind), run in _runs(anchors).items():
        _write_run(pool, layer, kind, slots, run + runs[(layer, kind)], "full")


def _check_coverage(placed, shape: KVShape, num_tokens: int) -> None:
    """Every layer's K and V must be tiled by Anchor chunks over [0, num_tokens)."""
    runs = _runs(placed)
    for layer in range(shape.num_layers):
        for kind in KINDS:
            covered = [(c.header.token_start, c.header.token_end) for c in runs.get((layer, kind), [])]
            pos = 0
            for start, end in covered:
                if start != pos:
                    break
                pos = end
            if pos != num_tokens:
                raise KVStreamError(f"Anchor stream covers tokens [0, {pos}) of layer {layer} "
                                    f"{kind.value}, not [0, {num_tokens})")
