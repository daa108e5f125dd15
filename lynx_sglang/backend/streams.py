"""How one request's KV cache becomes the two Lynx byte streams, and back into a KV pool.

The layout of the streams is the request's `StreamPlan` (`backend.plan`). Chunks are
self-describing (`lynx_kernels.parse_chunk`), so the decode walks a landed stream chunk by chunk.
Prefill reads a request's slots (`encode_layer_into` for every layer's Anchor, then
`write_residual_into`, straight into staging; `encode_layer` makes the same chunks as `bytes`).
Decode works layer by layer as bytes land: `parse_anchor_layer` + `write_anchor_layer` for the
Anchor, a `ResidualReader` over the Residual stream and `write_full_layer` for the full-precision
values.

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


# One layer's chunks of one stream: per kind, in token order, tiling [0, num_tokens).
LayerChunks = dict[StreamKind, list[Chunk]]


def _tile(chunks: list[Chunk], layer: int, num_tokens: int, what: str) -> LayerChunks:
    """Group one layer's chunks by kind and check each kind tiles [0, num_tokens) exactly."""
    out: LayerChunks = {kind: [] for kind in KINDS}
    for chunk in chunks:
        if chunk.header.layer != layer:
            raise KVStreamError(f"{what} chunk of layer {chunk.header.layer} where layer {layer}'s "
                                "belong")
        out[chunk.header.kind].append(chunk)
    for kind, run in out.items():
        run.sort(key=lambda c: c.header.token_start)
        pos = 0
        for c in run:
            if c.header.token_start != pos:
                break
            pos = c.header.token_end
        if pos != num_tokens or len({c.header.token_start for c in run}) != len(run):
            raise KVStreamError(f"{what} chunks of layer {layer} {kind.value} cover tokens "
                                f"[0, {pos}) (or overlap), not [0, {num_tokens})")
    return out


def parse_anchor_layer(layer_bytes: memoryview, shape: KVShape, layer: int, num_tokens: int,
                       spec: CodecSpec, request_tag: int) -> LayerChunks:
    """Validate one layer's landed Anchor bytes (every chunk, and that its K and V chunks tile
    [0, num_tokens)); nothing is written."""
    chunks = []
    for chunk in iter_chunks(layer_bytes):
        _check_header(chunk.header, spec, shape, num_tokens, request_tag, WireStream.ANCHOR)
        chunks.append(chunk)
    return _tile(chunks, layer, num_tokens, "Anchor")


def _assembled(chunks: list[Chunk], device) -> EncodedKV:
    try:
        return assemble(chunks, device=device)
    except CodecError as exc:
        raise KVStreamError(str(exc)) from exc


def write_anchor_layer(anchor: LayerChunks, pool: KVPoolView, layer: int,
                       slots: torch.Tensor) -> None:
    """Write one layer's Anchor reconstruction into the decode pool's `slots`."""
    # One decode and one indexed write per layer's K or V: the codec's per-call cost, not per
    # chunk. The values are the same as chunk by chunk (every step is per token or per group).
    for kind, run in anchor.items():
        pool.write(layer, kind, slots, decode(_assembled(run, pool.device), "anchor"))


def write_full_layer(anchor: LayerChunks, residual: LayerChunks, pool: KVPoolView, layer: int,
                     slots: torch.Tensor) -> None:
    """Write one layer's full-precision values (Anchor + Residual) into `slots`."""
    for kind in KINDS:
        if len(anchor[kind]) != len(residual[kind]) or any(
                a.header.token_end != r.header.token_end
                for a, r in zip(anchor[kind], residual[kind], strict=True)):
            raise KVStreamError(f"Residual chunks of layer {layer} {kind.value} do not match its "
                                "Anchor chunks")
        enc = _assembled(anchor[kind] + residual[kind], pool.device)
        pool.write(layer, kind, slots, decode(enc, "full"))


class ResidualReader:
    """Reads a Residual stream while it lands. `advance(view, landed)` parses the complete chunks
    among the first `landed` bytes (each validated) and returns the layers whose K and V chunks
    are all there, in layer order. The stream's chunks come layer by layer (the prefill writes
    them so); anything else is refused."""

    def __init__(self, shape: KVShape, num_tokens: int, spec: CodecSpec, request_tag: int):
        self.shape, self.num_tokens, self.spec, self.tag = shape, num_tokens, spec, request_tag
        self.pos = 0
        self.next_layer = 0
        self._current: list[Chunk] = []
        self._covered = 0

    @property
    def done(self) -> bool:
        return self.next_layer == self.shape.num_layers

    def advance(self, view: memoryview, landed: int) -> list[tuple[int, LayerChunks]]:
        ready = []
        while not self.done and landed - self.pos >= HEADER.size:
            payload_len = HEADER.unpack(view[self.pos: self.pos + HEADER.size])[-2]
            end = self.pos + HEADER.size + payload_len
            if end > landed:
                if end > len(view):
                    raise KVStreamError(f"Residual chunk at byte {self.pos} runs past the "
                                        f"stream end ({end} > {len(view)})")
                break
            chunk = parse_chunk(view[self.pos: end])
            _check_header(chunk.header, self.spec, self.shape, self.num_tokens, self.tag,
                          WireStream.RESIDUAL)
            if chunk.header.layer != self.next_layer:
                raise KVStreamError(f"Residual chunk of layer {chunk.header.layer} while layer "
                                    f"{self.next_layer} is incomplete")
            self.pos = end
            self._current.append(chunk)
            self._covered += chunk.header.num_tokens
            if self._covered == 2 * self.num_tokens:  # K and V of the layer
                ready.append((self.next_layer, _tile(self._current, self.next_layer,
                                                     self.num_tokens, "Residual")))
                self.next_layer += 1
                self._current, self._covered = [], 0
            elif self._covered > 2 * self.num_tokens:
                raise KVStreamError(f"Residual chunks of layer {self.next_layer} cover more than "
                                    f"its {self.num_tokens} tokens twice")
        return ready
