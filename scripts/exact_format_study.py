#!/usr/bin/env python3
"""Would a fixed-width block format code the exact Residual's corrections in few enough bytes?

The exact Residual (`lynx_kernels.exact`, ClassRice-256) codes each value's correction zz with a
Rice code whose parameter comes from the value's class (predicted from the INT8 reconstruction
and its group's scale). A Rice code is written value by value, which bounds the coder's speed on
one core (docs/codec.md, Speed). Formats whose fields have one width per block of values
bit-pack with vector instructions instead. This study measures, on the embedded SmolLM2-135M's
real KV (bf16, every layer, the default codec spec), the bits per coded value of:

  classrice      what the serving encoder actually sends (section bytes of the C encoder's output)
  entropy        H(zz | class): the ideal for any coder under the format's class model
  maxwidth-B     blocks of B values, each coded in the block's largest bit length (5-bit header)
  pfor-B         blocks of B values in a width w chosen per block; values above w are exceptions
                 (index + 16 raw bits each; header: width and exception count)
  classwidth-B   ClassRice's split kept, its unary part made fixed-width: the k[class] low bits of
                 zz (widths known from the classes, so positions come from a prefix sum), and the
                 quotients zz >> k in blocks of B at the block's largest bit length (3-bit header);
                 k per class chosen per run to minimise that

and what each makes the whole Residual (4 low bits + corrections), as a fraction of BF16.
Writes JSON (default out/exact_format_study.json). The numbers are documented in docs/codec.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from lynx_kernels import CodecSpec, preset
from lynx_kernels import exact as exact_coding
from lynx_kernels.codec import protected_positions
from lynx_kernels.wire import HEADER
from lynx_tools.codec import measure as codec_measure
from lynx_tools.codec.sample_kv import real_kv

BLOCKS = (8, 32, 128)
WIDTH_HEADER_BITS = 5  # widths 0..16


def bitlen(z: torch.Tensor) -> torch.Tensor:
    """Bit length of each non-negative value (0 for 0)."""
    out = torch.zeros_like(z)
    nz = z > 0
    out[nz] = torch.floor(torch.log2(z[nz].double())).long() + 1
    return out


def blocks_of(z: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([z, z.new_zeros((-z.numel()) % size)]).view(-1, size)


def maxwidth_bits(lengths: torch.Tensor, size: int) -> int:
    b = blocks_of(lengths, size)
    return int((b.max(1).values * size + WIDTH_HEADER_BITS).sum())


def pfor_bits(lengths: torch.Tensor, size: int, raw_bits: int) -> int:
    b = blocks_of(lengths, size)
    index_bits = math.ceil(math.log2(size))
    header = WIDTH_HEADER_BITS + index_bits + 1
    best = None
    for w in range(raw_bits + 1):
        cost = size * w + (b > w).sum(1) * (index_bits + raw_bits) + header
        best = cost if best is None else torch.minimum(best, cost)
    return int(best.sum())


def classwidth_bits(zz: torch.Tensor, cls: torch.Tensor, size: int) -> int:
    """classwidth-B's bits with the k table (per class) that minimises them, found greedily one
    class at a time from k = 0 (the block maxima couple the classes)."""
    k = torch.zeros(exact_coding.NUM_CLASSES, dtype=torch.long)

    def cost(table: torch.Tensor) -> int:
        kv = table[cls]
        q = bitlen(zz >> kv)
        return int(kv.sum()) + int((blocks_of(q, size).max(1).values * size + 3).sum())

    best = cost(k)
    for c in range(exact_coding.NUM_CLASSES):
        if not bool((cls == c).any()):
            continue
        for j in range(1, 16):
            trial = k.clone()
            trial[c] = j
            t = cost(trial)
            if t < best:
                best, k = t, trial
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=Path("out/exact_format_study.json"))
    args = parser.parse_args(argv)

    shape = preset("SmolLM2-135M")
    sample = real_kv(shape, args.prompts, args.prompt_tokens)
    spec = CodecSpec(target="exact")
    int8 = CodecSpec(target="int8")
    bits = {"classrice": 0, **{f"maxwidth-{b}": 0 for b in BLOCKS},
            **{f"pfor-{b}": 0 for b in BLOCKS},
            **{f"classwidth-{b}": 0 for b in (4, 8)}}
    values = 0
    hist = None
    for seq, layer, kind, x in sample.runs():
        tokens, heads, head_dim = x.shape
        coding = exact_coding.CODINGS[x.dtype]
        keep = torch.ones(tokens, dtype=torch.bool)
        keep[protected_positions(tokens, spec.sink_tokens, spec.recent_tokens, 0, tokens)] = False
        anchor, residual = codec_measure._wire(x, torch.arange(tokens), spec, kind, layer, seq,
                                               args.chunk_tokens)
        prediction = codec_measure.int8_reconstruction(x, int8, kind, layer, seq, args.chunk_tokens)
        x_bits = exact_coding.value_bits(x)[keep].reshape(-1)
        r_bits = exact_coding.value_bits(prediction)[keep].reshape(-1)
        zz = exact_coding.zigzag(exact_coding.ordinal(x_bits, coding)
                                 - exact_coding.ordinal(r_bits, coding)).long()
        scale = codec_measure.assemble(codec_measure._chunk_views(anchor)).scale
        e_s = exact_coding.scale_exponents(scale, tokens, heads, head_dim, spec.group_size,
                                           spec.groups_over_tokens(kind), spec.rotate)
        cls = exact_coding.classes(r_bits, e_s[keep].reshape(-1), coding).long()
        chunks = -(-tokens // args.chunk_tokens)
        low_bits = tokens * heads * head_dim * (8 - spec.anchor_bits)
        bits["classrice"] += residual.size * 8 - chunks * HEADER.size * 8 - low_bits
        lengths = bitlen(zz)
        for b in BLOCKS:
            bits[f"maxwidth-{b}"] += maxwidth_bits(lengths, b)
            bits[f"pfor-{b}"] += pfor_bits(lengths, b, coding.width)
        for b in (4, 8):
            bits[f"classwidth-{b}"] += classwidth_bits(zz, cls, b)
        span = 1 << (coding.width + 1)
        h = torch.bincount(cls * span + zz, minlength=exact_coding.NUM_CLASSES * span)
        hist = h if hist is None else hist + h
        values += zz.numel()
    p = hist.view(exact_coding.NUM_CLASSES, -1).double()
    per_class = p.sum(1, keepdim=True)
    q = torch.where(p > 0, p / per_class.clamp(min=1), torch.ones_like(p))
    entropy = float(-(p * torch.log2(q)).sum() / values)
    per_value = {name: total / values for name, total in bits.items()}
    per_value["entropy"] = entropy
    low = 8 - spec.anchor_bits
    report = {
        "kv": sample.description, "spec": "CodecSpec() defaults, bf16 KV",
        "coded_values": values,
        "bits_per_value": per_value,
        "residual_fraction_of_bf16": {k: (low + v) / 16 for k, v in per_value.items()},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(sample.description)
    print(f"{'format':14s} {'bits/value':>10s} {'Residual ÷ BF16':>16s}")
    for name, v in sorted(per_value.items(), key=lambda kv: kv[1]):
        print(f"{name:14s} {v:10.3f} {(low + v) / 16:16.3f}")
    print(f"(wrote {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
