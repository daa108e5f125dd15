"""Inputs and helpers shared by the codec tests: KV pools (random and adversarial), a fused-API
round trip, and re-sealing a chunk (valid CRC) after tampering with it."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from lynx_kernels import CodecSpec, fused
from lynx_kernels.wire import HEADER

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HEADER_FIELDS = {name: i for i, name in enumerate(
    ("magic", "version", "stream", "kind", "dtype", "flags", "anchor_bits", "group_size", "layer",
     "heads", "head_dim", "sink", "recent", "seed", "tag", "total", "start", "end", "payload_len",
     "crc"))}


@dataclass(frozen=True)
class Run:
    """One (layer, kind) run of a fused-API call: the pool, the request's slots, how it is cut."""

    pool: torch.Tensor
    slots: torch.Tensor
    spec: CodecSpec
    kind: str
    chunk_tokens: int
    layer: int = 3
    tag: int = 77

    @property
    def tokens(self) -> int:
        return len(self.slots)

    def values(self) -> torch.Tensor:
        return self.pool[self.slots]

    def encode(self, impl: str) -> tuple[bytes, bytes]:
        _, heads, head_dim = self.pool.shape
        sizes = fused.run_nbytes(self.spec, self.kind, self.pool.dtype, heads, head_dim,
                                 self.tokens, self.chunk_tokens)
        anchor = np.zeros(sizes.anchor, np.uint8)
        residual = np.zeros(sizes.residual_bound, np.uint8)
        na, nr = fused.encode_run_into(self.pool, self.slots, self.spec, self.kind, self.layer,
                                       self.chunk_tokens, self.tag, anchor, residual, impl=impl)
        assert na == sizes.anchor and nr <= sizes.residual_bound
        return anchor[:na].tobytes(), residual[:nr].tobytes()

    def encode_anchor_only(self, impl: str) -> bytes:
        _, heads, head_dim = self.pool.shape
        sizes = fused.run_nbytes(self.spec, self.kind, self.pool.dtype, heads, head_dim,
                                 self.tokens, self.chunk_tokens)
        anchor = np.zeros(sizes.anchor, np.uint8)
        na, nr = fused.encode_run_into(self.pool, self.slots, self.spec, self.kind, self.layer,
                                       self.chunk_tokens, self.tag, anchor, None, impl=impl)
        assert na == sizes.anchor and nr == 0
        return anchor.tobytes()

    def apply(self, impl: str, anchor: bytes, residual: bytes | None = None,
              into: torch.Tensor | None = None) -> torch.Tensor:
        """A fresh pool (or `into`) after applying the Anchor, or Anchor then Residual."""
        pool = torch.full_like(self.pool, 3.0) if into is None else into
        args = (pool, self.slots, self.spec, self.kind, self.layer, self.tag, self.tokens)
        if residual is None:
            fused.apply_anchor_run(anchor, *args, impl=impl)
        else:
            fused.apply_residual_run(anchor, residual, *args, impl=impl)
        return pool


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns, for bit-exact comparisons (NaN-safe, +0 != -0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def make_run(values: torch.Tensor, spec: CodecSpec, kind: str, chunk_tokens: int, seed: int = 0,
             spare_rows: int = 7) -> Run:
    """A pool holding `values` [tokens, heads, head_dim] at shuffled rows, among spare rows."""
    tokens = values.shape[0]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((tokens + spare_rows, *values.shape[1:]), generator=gen).to(values.dtype)
    slots = torch.randperm(tokens + spare_rows, generator=gen)[:tokens]
    pool[slots] = values
    return Run(pool, slots, spec, kind, chunk_tokens)


def chunks_of(stream: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos < len(stream):
        end = pos + HEADER.size + HEADER.unpack_from(stream, pos)[HEADER_FIELDS["payload_len"]]
        out.append(stream[pos:end])
        pos = end
    return out


def reseal(chunk: bytes, payload: bytes | None = None, **fields) -> bytes:
    """The chunk with header fields and/or payload replaced and a CRC that matches again."""
    values = list(HEADER.unpack(chunk[:HEADER.size]))
    payload = chunk[HEADER.size:] if payload is None else payload
    values[HEADER_FIELDS["payload_len"]] = len(payload)
    for name, value in fields.items():
        values[HEADER_FIELDS[name]] = value
    values[HEADER_FIELDS["crc"]] = 0
    crc = zlib.crc32(payload, zlib.crc32(HEADER.pack(*values)))
    values[HEADER_FIELDS["crc"]] = crc
    return HEADER.pack(*values) + payload


def adversarial(dtype: torch.dtype, tokens: int, heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    """Named inputs that stress the exact path: constants, zeros of both signs, subnormals, huge
    and infinite values, wild magnitudes, sign crossings."""
    shape = (tokens, heads, head_dim)
    gen = torch.Generator().manual_seed(tokens * 31 + head_dim)
    x = torch.randn(shape, generator=gen)
    tiny = torch.finfo(dtype).tiny
    big = {torch.float16: 60000.0, torch.bfloat16: 3e38, torch.float32: 3e38}[dtype]
    cases = {
        "constant": torch.full(shape, 0.8125),
        "zeros": torch.zeros(shape),
        "signed_zeros": torch.where(x > 0, 0.0, -0.0),
        "subnormals": x * tiny * 0.25,
        "tiny_and_zero": torch.where(x > 0.5, x * tiny * 4, torch.where(x < -1, -0.0, 0.0)),
        "huge": x.sign() * big * torch.rand(shape, generator=gen),
        "inf_mix": torch.where(x > 1.5, torch.inf, torch.where(x < -1.5, -torch.inf, x)),
        "wild_magnitudes": x.sign() * torch.exp2(torch.randint(-30, 12, shape, generator=gen).float()),
        "sign_crossings": x * 1e-3 + torch.where(torch.rand(shape, generator=gen) < 0.02, 40.0, 0.0),
        "one_outlier_channel": x + torch.where(torch.arange(head_dim) == 5, 500.0, 0.0),
    }
    return {name: value.to(dtype) for name, value in cases.items()}


@st.composite
def specs(draw, kind: str | None = None, head_dim: int | None = None) -> tuple[CodecSpec, str, int]:
    """(spec, kind, head_dim) with per-token grouping only where head_dim allows it."""
    kind = kind or draw(st.sampled_from(["k", "v"]))
    group = draw(st.sampled_from([32, 64, 128]))
    k_grouping = draw(st.sampled_from(["channel", "token"]))
    per_token = kind == "v" or k_grouping == "token"
    if head_dim is None:
        head_dim = draw(st.sampled_from([d for d in (32, 64, 128) if not per_token or d % group == 0]))
    elif per_token and head_dim % group:
        group = 32
    spec = CodecSpec(
        anchor_bits=draw(st.integers(2, 6)), group_size=group,
        target=draw(st.sampled_from(["int8", "exact"])), k_grouping=k_grouping,
        sink_tokens=draw(st.integers(0, 6)), recent_tokens=draw(st.integers(0, 40)),
        rotate=draw(st.booleans()), rotation_seed=draw(st.integers(0, 2**32 - 1)),
    )
    return spec, kind, head_dim
