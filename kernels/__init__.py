"""Lynx KV codec: split quantized KV into an Anchor (top bits, sent first) and a Residual.

    from lynx_kernels import CodecSpec, encode, decode
    spec = CodecSpec(anchor_bits=4, group_size=64, target="int8")   # or target="exact"
    enc = encode(x, spec, kind="k")          # x: [tokens, kv_heads, head_dim]
    approx = decode(enc, stage="anchor")      # same shape/dtype as x
    full = decode(enc, stage="full")          # target precision; bit-identical to x for "exact"
    enc.nbytes("anchor"), enc.nbytes("residual")   # bytes in memory (exact: uncoded)
    wire_nbytes(enc, 256, stream="residual")        # bytes on the wire, headers and coding included

Wire format: `to_chunks(enc, chunk_tokens, stream=...)` -> bytes chunks (or `write_chunks` straight
into a buffer); `parse_chunk`, `assemble` on the receiving side; `refine_(pool_slots, enc)`
rewrites Anchor-precision values in place.

Serving path, one call per (layer, kind) of a request, pool rows straight to wire bytes and back
(C kernels on CPU, Triton on CUDA): `encode_run_into`, `apply_anchor_run`, `apply_residual_run`,
sized by `run_nbytes`.

Modules: spec (parameters), codec (encode/decode), wire (the chunk format, reading chunks),
wire_write (writing them), exact (the exact Residual's format), fused (the serving calls), sizes
(byte accounting), shapes (model KV presets), rotation, ops_torch (reference), ops_cpu (C kernels),
ops_triton (CUDA kernels). This package never imports SGLang.
"""

from .codec import EncodedKV, decode, encode, protected_positions, refine_
from .fused import RunBytes, apply_anchor_run, apply_residual_run, encode_run_into, run_nbytes
from .shapes import PRESETS, KVShape, model_shape, preset
from .sizes import StreamBytes, quantized_nbytes_per_token, stream_nbytes_per_token
from .spec import CodecError, CodecSpec, KGrouping, Stage, StreamKind, Target
from .wire import (
    Chunk,
    ChunkHeader,
    WireStream,
    assemble,
    parse_chunk,
)
from .wire_write import to_chunks, wire_nbytes, write_chunks

__all__ = [
    "PRESETS",
    "Chunk",
    "ChunkHeader",
    "CodecError",
    "CodecSpec",
    "EncodedKV",
    "KGrouping",
    "KVShape",
    "RunBytes",
    "Stage",
    "StreamBytes",
    "StreamKind",
    "Target",
    "WireStream",
    "apply_anchor_run",
    "apply_residual_run",
    "assemble",
    "decode",
    "encode",
    "encode_run_into",
    "model_shape",
    "parse_chunk",
    "preset",
    "protected_positions",
    "quantized_nbytes_per_token",
    "refine_",
    "run_nbytes",
    "stream_nbytes_per_token",
    "to_chunks",
    "wire_nbytes",
    "write_chunks",
]
