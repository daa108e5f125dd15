"""`StreamPlan`: the byte layout of one request's two streams, computed once from what both ends
know before anything is encoded (codec settings, KV shape, token count, chunk size).

Stream layout: for layer 0..L-1, for K then V, the wire chunks of tokens [0, T) cut every
`chunk_tokens` tokens (`lynx_kernels.to_chunks`), concatenated. Every layer's share of the Anchor
stream has the same length, so layer l's Anchor lies at `anchor_offset(l)`. The Residual's layers
also follow one another, but an exact Residual is coded, so its size depends on the values: the
plan gives each layer's bound (`residual_layer_bytes`), and the decode finds the layers by walking
the self-describing chunks. A request's staging range holds the Anchor stream then room for the
Residual stream's bound (`staging_bytes`). The decode sizes and announces its staging range from the plan
(`backend.decode`), the prefill checks the announcement against its own plan and writes each layer
at the plan's offsets (`backend.prefill`), and the decode parses the landed streams with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lynx_kernels import ChunkHeader, CodecSpec, KVShape, WireStream
from lynx_kernels.wire import HEADER

from ..errors import KVStreamError
from .pool import KINDS


@dataclass(frozen=True)
class StreamPlan:
    num_tokens: int
    num_layers: int
    chunk_tokens: int
    anchor_layer_bytes: int
    residual_layer_bytes: int

    @classmethod
    def build(cls, spec: CodecSpec, shape: KVShape, num_tokens: int,
              chunk_tokens: int) -> StreamPlan:
        if num_tokens <= 0:
            raise KVStreamError(f"a request must have at least one token, got {num_tokens}")
        per_layer = {WireStream.ANCHOR: 0, WireStream.RESIDUAL: 0}
        for kind in KINDS:
            for start in range(0, num_tokens, chunk_tokens):
                end = min(start + chunk_tokens, num_tokens)
                for stream in per_layer:
                    header = ChunkHeader(
                        stream=stream, spec=spec, kind=kind, dtype=shape.dtype, layer=0,
                        num_heads=shape.num_kv_heads, head_dim=shape.head_dim, request_tag=0,
                        total_tokens=num_tokens, token_start=start, token_end=end,
                        payload_len=0)
                    per_layer[stream] += HEADER.size + sum(header.section_sizes().values())
        return cls(num_tokens, shape.num_layers, chunk_tokens, per_layer[WireStream.ANCHOR],
                   per_layer[WireStream.RESIDUAL])

    @property
    def anchor_bytes(self) -> int:
        return self.num_layers * self.anchor_layer_bytes

    @property
    def residual_bytes(self) -> int:
        return self.num_layers * self.residual_layer_bytes

    @property
    def staging_bytes(self) -> int:
        """Anchor then Residual, back to back."""
        return self.anchor_bytes + self.residual_bytes

    @property
    def residual_bytes_expected(self) -> int:
        """What the Residual stream is expected to carry (its exact size for the fixed-size
        formats; the speculation decision estimates its arrival from it)."""
        return self.residual_bytes

    def stream_bytes(self, stream: WireStream) -> int:
        return self.anchor_bytes if stream is WireStream.ANCHOR else self.residual_bytes

    def anchor_offset(self, layer: int) -> int:
        """Where layer `layer`'s Anchor chunks start in the Anchor stream (and in staging)."""
        return layer * self.anchor_layer_bytes

