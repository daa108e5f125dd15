"""The KV variants the Anchor quality study compares (`lynx_tools.study.anchor_study` calls `apply`).

A variant maps one layer's exact K or V, `[tokens, kv_heads, head_dim]` fp32 as the model caches it
(K after RoPE), to what a decode server would attend over instead:
  ANCHOR    the Lynx Anchor: `lynx_kernels.encode` then `decode(stage="anchor")` (bucket midpoints
            of the top `anchor_bits` of the INT8 code; protected sink/recent tokens exact);
  MINMAX    plain b-bit KV, KIVI-style: per-group asymmetric min-max, codes round-to-nearest in
            0..2**b-1, fp16 zero (group min rounded down) and fp16 scale ((max-min)/(2**b-1) rounded
            up), K grouped per channel over `group_size` tokens, V per token over `group_size`
            channels, no full-precision window; a baseline, not the codec;
  BF16      values rounded to bfloat16 (what a BF16 KV pool holds);
  IDENTITY  the exact values (test reference);
  ZERO      all zeros (a deliberately broken variant for tests).
`apply` returns a new tensor; the input is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from lynx_kernels import CodecSpec, decode, encode, quantized_nbytes_per_token, stream_nbytes_per_token


class VariantKind(str, Enum):
    ANCHOR = "anchor"
    MINMAX = "minmax"
    BF16 = "bf16"
    IDENTITY = "identity"
    ZERO = "zero"


BF16_BYTES = 2


@dataclass(frozen=True)
class KVVariant:
    """One way of approximating the prefix KV; `spec` for ANCHOR, `bits`/`group_size` for MINMAX.

    `v_spec`, if given, encodes V instead of `spec`: V is grouped per token within a head, so a
    group of 128 does not fit head_dim 64 and "group 128" can only apply to K there. A CodecSpec is
    shared by K and V today, so such a variant is not deployable without a per-kind group size.
    """

    name: str
    kind: VariantKind
    spec: CodecSpec | None = None
    bits: int | None = None
    group_size: int = 64
    v_spec: CodecSpec | None = None

    def __post_init__(self) -> None:
        if (self.kind is VariantKind.ANCHOR) != (self.spec is not None):
            raise ValueError(f"variant {self.name}: a spec is given exactly for ANCHOR variants")
        if self.kind is VariantKind.MINMAX and self.bits not in (1, 2, 3, 4, 5, 6, 7, 8):
            raise ValueError(f"variant {self.name}: MINMAX needs bits in 1..8, got {self.bits!r}")

    def apply(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        """`x` [tokens, kv_heads, head_dim] -> the variant's values, same shape and dtype."""
        if self.kind is VariantKind.ANCHOR:
            spec = self.v_spec if kind == "v" and self.v_spec is not None else self.spec
            return decode(encode(x, spec, kind, layer=layer), "anchor")
        if self.kind is VariantKind.MINMAX:
            return minmax_quantize(x, self.bits, self.group_size, over_tokens=kind == "k")
        if self.kind is VariantKind.BF16:
            return x.to(torch.bfloat16).to(x.dtype)
        if self.kind is VariantKind.IDENTITY:
            return x.clone()
        return torch.zeros_like(x)

    def bytes_ratio(self, num_kv_heads: int, head_dim: int, context_tokens: int) -> float:
        """Bytes this variant needs per token (K + V) relative to BF16 KV, at `context_tokens`.

        Protected tokens of an Anchor are counted at BF16 size (the pool dtype of a deployment).
        """
        bf16 = 2 * num_kv_heads * head_dim * BF16_BYTES
        if self.kind is VariantKind.ANCHOR:
            # stream_nbytes_per_token counts K and V with one spec: average the K and V halves.
            per = [stream_nbytes_per_token(s, num_kv_heads, head_dim, BF16_BYTES,
                                           context_tokens).anchor / bf16
                   for s in (self.spec, self.v_spec or self.spec)]
            return sum(per) / 2
        if self.kind is VariantKind.MINMAX:
            return quantized_nbytes_per_token(self.bits, num_kv_heads, head_dim,
                                              self.group_size) / bf16
        if self.kind is VariantKind.ZERO:
            return 0.0
        return 1.0


def minmax_quantize(x: torch.Tensor, bits: int, group_size: int, over_tokens: bool) -> torch.Tensor:
    """Quantize-dequantize `[tokens, heads, head_dim]` to `bits` bits per value (see module doc)."""
    tokens, heads, head_dim = x.shape
    hd = heads * head_dim
    x2 = x.to(torch.float32).reshape(tokens, hd)
    if over_tokens:
        groups = -(-tokens // group_size)
        pad = groups * group_size - tokens
        # Padding repeats the last token so it never widens a group's range.
        padded = torch.cat([x2, x2[-1:].expand(pad, hd)]) if pad else x2
        view = padded.view(groups, group_size, hd)
        lo, hi = view.amin(dim=1, keepdim=True), view.amax(dim=1, keepdim=True)
    else:
        if hd % group_size:
            raise ValueError(f"heads*head_dim={hd} is not divisible by group_size={group_size}")
        view = x2.view(tokens, hd // group_size, group_size)
        lo, hi = view.amin(dim=-1, keepdim=True), view.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    zero = _fp16_toward(lo, -torch.inf)
    scale = _fp16_toward((hi - zero) / levels, torch.inf)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = ((view - zero) * inv).round().clamp(0, levels)
    out = (zero + codes * scale).reshape(-1, hd)[:tokens]
    return out.reshape(tokens, heads, head_dim).to(x.dtype)


def _fp16_toward(v: torch.Tensor, direction: float) -> torch.Tensor:
    """fp32 values of `v` rounded to fp16, stepping one fp16 ulp toward `direction` if rounding went
    the wrong way (so the zero stays <= the minimum and scale * levels covers the range)."""
    h = v.to(torch.float16)
    wrong = h.float() > v if direction < 0 else h.float() < v
    return torch.where(wrong, torch.nextafter(h, torch.full_like(h, direction)), h).float()


# The naive Anchor's settings; every study variant states what it adds to them.
_NAIVE_KW = {"sink_tokens": 0, "recent_tokens": 0, "rotate": False}


def _anchor(name: str, **kw) -> KVVariant:
    return KVVariant(name, VariantKind.ANCHOR, spec=CodecSpec(**(_NAIVE_KW | kw)))


def _anchor_k128(name: str, **kw) -> KVVariant:
    """K grouped per channel over 128 tokens, V as usual in groups of 64 channels."""
    return KVVariant(name, VariantKind.ANCHOR, spec=CodecSpec(**(_NAIVE_KW | kw), group_size=128),
                     v_spec=CodecSpec(**(_NAIVE_KW | kw), group_size=64))


NAIVE = _anchor("naive", anchor_bits=4, group_size=64, k_grouping="channel")

STUDY_VARIANTS: tuple[KVVariant, ...] = (
    NAIVE,
    _anchor("bits3", anchor_bits=3),
    _anchor("bits5", anchor_bits=5),
    _anchor("k-token", k_grouping="token"),
    _anchor("g32", group_size=32),
    _anchor_k128("k-g128"),
    _anchor("rot", rotate=True),
    _anchor("k-token+rot", k_grouping="token", rotate=True),
    _anchor("sink4", sink_tokens=4),
    _anchor("sink4+r16", sink_tokens=4, recent_tokens=16),
    _anchor("sink4+r64", sink_tokens=4, recent_tokens=64),
    _anchor("rot+sink4", rotate=True, sink_tokens=4),
    _anchor("rot+sink4+r16", rotate=True, sink_tokens=4, recent_tokens=16),
    _anchor("rot+sink4+r64", rotate=True, sink_tokens=4, recent_tokens=64),
    _anchor_k128("k-g128+rot+sink4+r16", rotate=True, sink_tokens=4, recent_tokens=16),
    _anchor_k128("k-g128+rot+sink4+r64", rotate=True, sink_tokens=4, recent_tokens=64),
    _anchor("bits3+rot+sink4+r16", anchor_bits=3, rotate=True, sink_tokens=4, recent_tokens=16),
    KVVariant("int4-kivi", VariantKind.MINMAX, bits=4, group_size=64),
    KVVariant("int2-kivi", VariantKind.MINMAX, bits=2, group_size=64),
    KVVariant("bf16", VariantKind.BF16),
)
TEST_VARIANTS: tuple[KVVariant, ...] = (
    KVVariant("identity", VariantKind.IDENTITY),
    KVVariant("zero", VariantKind.ZERO),
)


def variant_by_name(name: str) -> KVVariant:
    for v in STUDY_VARIANTS + TEST_VARIANTS:
        if v.name == name:
            return v
    raise ValueError(f"unknown variant {name!r}; known: {[v.name for v in STUDY_VARIANTS + TEST_VARIANTS]}")
