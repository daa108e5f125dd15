"""`lynx-sglang codec-report`: what the codec costs and how close it gets, for one model's KV shape.

Prints bytes per token of each stream for the whole model (all layers, K and V) next to BF16, INT8
and INT4 KV, and error statistics of the Anchor and of the full decode measured by encoding sample
KV; writes the same as JSON. The sample KV is synthetic (stated in the output): Gaussian values with
per-channel scales, a few outlier channels in K and a large attention-sink token 0, which is what
makes K hard to quantize in real models.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lynx_kernels import (
    PRESETS,
    CodecSpec,
    decode,
    encode,
    preset,
    quantized_nbytes_per_token,
    stream_nbytes_per_token,
)

log = logging.getLogger("lynx.codec_report")

SAMPLE_KV = ("synthetic: N(0,1) x per-channel log-normal scales, 4% of K channels x8 (outliers), "
             "token 0 x20 (attention sink)")


@dataclass(frozen=True)
class ErrorStats:
    """Reconstruction error of one stage over all sampled values."""

    relative_rmse: float  # rms(error) / rms(value)
    snr_db: float
    max_abs_error: float
    cosine_similarity: float  # mean over (token, head) rows


@dataclass(frozen=True)
class Report:
    model: str
    spec: dict
    tokens: int
    sample_kv: str
    bytes_per_token: dict[str, float]
    ratio_to_bf16: dict[str, float]
    anchor_error: ErrorStats
    full_error: ErrorStats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="SmolLM2-135M",
                        help=f"KV shape preset: {', '.join(PRESETS)} (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="context length of the sample KV (default: %(default)s)")
    parser.add_argument("--anchor-bits", type=int, default=4, help="default: %(default)s")
    parser.add_argument("--group-size", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--target", choices=["int8", "exact"], default="int8",
                        help="what Anchor+Residual reconstruct (default: %(default)s)")
    parser.add_argument("--k-grouping", choices=["channel", "token"], default="channel",
                        help="K scale/zero groups (default: %(default)s)")
    parser.add_argument("--sink-tokens", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--recent-tokens", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--rotate", action="store_true", help="Hadamard rotation before quantizing")
    parser.add_argument("--sample-layers", type=int, default=2,
                        help="layers of sample KV to encode for the error figures (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="sample KV seed (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the report here (default: out/codec_report_<model>.json)")


def sample_kv(tokens: int, heads: int, head_dim: int, kind: str, gen: torch.Generator):
    channel_scale = torch.exp(0.5 * torch.randn((heads, head_dim), generator=gen))
    if kind == "k":
        outliers = torch.rand((heads, head_dim), generator=gen) < 0.04
        channel_scale = torch.where(outliers, channel_scale * 8, channel_scale)
    x = torch.randn((tokens, heads, head_dim), generator=gen) * channel_scale
    x[0] *= 20
    return x.to(torch.bfloat16)


def _stats(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> ErrorStats:
    x = torch.cat([p[0].float().flatten() for p in parts])
    y = torch.cat([p[1].float().flatten() for p in parts])
    err = y - x
    rmse = float(err.pow(2).mean().sqrt())
    rms = float(x.pow(2).mean().sqrt())
    cos = torch.cat([torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).flatten()
                     for a, b in parts])
    return ErrorStats(
        relative_rmse=rmse / rms,
        snr_db=math.inf if rmse == 0 else 20 * math.log10(rms / rmse),
        max_abs_error=float(err.abs().max()),
        cosine_similarity=float(cos.mean()),
    )


def build_report(args: argparse.Namespace) -> Report:
    shape = preset(args.model)
    spec = CodecSpec(anchor_bits=args.anchor_bits, group_size=args.group_size, target=args.target,
                     k_grouping=args.k_grouping, sink_tokens=args.sink_tokens,
                     recent_tokens=args.recent_tokens, rotate=args.rotate)
    per_layer = stream_nbytes_per_token(spec, shape.num_kv_heads, shape.head_dim, 2,
                                        context_tokens=args.tokens)
    layers = shape.num_layers
    bf16 = shape.bf16_bytes_per_token()
    nbytes = {
        "anchor": per_layer.anchor * layers,
        "residual": per_layer.residual * layers,
        "anchor+residual": per_layer.total * layers,
        "bf16": float(bf16),
        "int8": quantized_nbytes_per_token(8, shape.num_kv_heads, shape.head_dim,
                                           args.group_size) * layers,
        "int4": quantized_nbytes_per_token(4, shape.num_kv_heads, shape.head_dim,
                                           args.group_size) * layers,
    }
    gen = torch.Generator().manual_seed(args.seed)
    anchor_parts, full_parts = [], []
    for layer in range(args.sample_layers):
        for kind in ("k", "v"):
            x = sample_kv(args.tokens, shape.num_kv_heads, shape.head_dim, kind, gen)
            enc = encode(x, spec, kind, layer=layer)
            anchor_parts.append((x, decode(enc, "anchor")))
            full_parts.append((x, decode(enc, "full")))
    return Report(
        model=shape.name, spec={k: getattr(v, "value", v) for k, v in asdict(spec).items()},
        tokens=args.tokens, sample_kv=SAMPLE_KV, bytes_per_token=nbytes,
        ratio_to_bf16={k: v / bf16 for k, v in nbytes.items()},
        anchor_error=_stats(anchor_parts), full_error=_stats(full_parts),
    )


def format_report(report: Report) -> str:
    lines = [f"Lynx codec report — {report.model}, {report.tokens} tokens, spec {report.spec}",
             "", f"{'stream':<18}{'bytes/token':>14}{'÷ BF16':>10}"]
    for name, value in report.bytes_per_token.items():
        lines.append(f"{name:<18}{value:>14,.0f}{report.ratio_to_bf16[name]:>10.3f}")
    lines += ["", f"sample KV: {report.sample_kv}",
              f"{'stage':<10}{'rel. RMSE':>12}{'SNR dB':>10}{'max |err|':>12}{'cosine':>10}"]
    for stage, stats in (("anchor", report.anchor_error), ("full", report.full_error)):
        lines.append(f"{stage:<10}{stats.relative_rmse:>12.5f}{stats.snr_db:>10.2f}"
                     f"{stats.max_abs_error:>12.5f}{stats.cosine_similarity:>10.6f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(format_report(report))
    path = args.json or Path("out") / f"codec_report_{report.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(report), indent=2, allow_nan=True) + "\n")
    log.info("wrote %s", path)
    return 0
