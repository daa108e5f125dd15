"""`lynx-sglang codec-report`: what the codec puts on the wire for one model's KV, and how close to
the ideal that is.

For each target (int8 and exact) with one codec spec (by default `CodecSpec()`'s: 4 Anchor bits,
group 64, K per channel, rotation, 4 sink and 16 recent tokens), every (sequence, layer, K/V) run of
the sample KV is encoded with the serving call (`lynx_kernels.fused.encode_run_into`, chunks of
`--chunk-tokens` tokens) and decoded back from those bytes (`apply_anchor_run`,
`apply_residual_run`). Reported:
  - wire bytes per token for the whole model (all layers) of the Anchor, the Residual and both,
    chunk headers included, for K, V and K+V, and as ratios to the BF16 bytes, next to BF16, INT8
    and INT4 KV (codes + fp16 scale/zero per group);
  - for the exact target the ideal: the Anchor + the Residual's low bits (as sent) + the empirical
    entropy H(c | class) of the corrections (c and class as in `lynx_kernels.exact`, against the
    INT8 reconstruction `lynx_kernels.codec.exact_parts` gives, here decoded by the C kernels; one
    histogram per kind over every measured value, so K+V is H(c | kind, class)), i.e. what a
    perfect entropy coder of the corrections under the format's class model would send, and the
    bits per value the ClassRice coder actually spends on them;
  - error statistics of the Anchor and of the full decode over all values; the exact target's full
    decode must be bit-identical to the KV (checked on every run: the report fails otherwise).

Sample KV (`--kv`; the output says which):
  real       the KV of the embedded SmolLM2-135M-Instruct (`lynx_tools.model`, transformers on
             CPU, bf16, no hub access) over `--prompts` study prompts of about `--prompt-tokens`
             tokens (`lynx_tools.study.prompts`), every layer. K is post-RoPE (transformers
             caches it after the rotary embedding), which is what SGLang's KV pool holds too.
             The default for SmolLM2-135M; other shapes have no model here.
  synthetic  `--sample-layers` layers of `--tokens` tokens of Gaussian values with per-channel
             log-normal scales, a few outlier channels in K and a large attention-sink token 0 (what
             makes K hard to quantize in real models), scaled to the model's layer count. The
             default for the other shapes (Llama-3.1-8B).
Writes the report (`Report`, dataclasses: `lynx_tools.codec.schema`) as JSON, default
out/codec_report_<model>.json. The sample KV: `lynx_tools.codec.sample_kv`; the measuring:
`lynx_tools.codec.measure`. This module owns the CLI and the printed tables.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch

from lynx_kernels import PRESETS, CodecSpec, KGrouping, Target, model_shape, quantized_nbytes_per_token

from .measure import TargetSums
from .sample_kv import EMBEDDED_NAME, REAL_MODEL, real_kv, synthetic_kv
from .schema import Report

log = logging.getLogger("lynx.codec_report")

_DEFAULT = CodecSpec()


# ----------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=REAL_MODEL,
                        help=f"KV shape: a preset ({', '.join(PRESETS)}) or any Hugging Face "
                             "model folder / config.json (its KV shape; synthetic KV) "
                             "(default: %(default)s)")
    parser.add_argument("--kv", choices=["real", "synthetic"], default=None,
                        help=f"sample KV: 'real' = the embedded {EMBEDDED_NAME}'s KV over study "
                             f"prompts (only for {REAL_MODEL}), 'synthetic' = generated "
                             f"(default: real for {REAL_MODEL}, synthetic otherwise)")
    parser.add_argument("--prompts", type=int, default=4,
                        help="real KV: number of study prompts (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1500,
                        help="real KV: about this many tokens per prompt (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="synthetic KV: context length (default: %(default)s)")
    parser.add_argument("--sample-layers", type=int, default=2,
                        help="synthetic KV: layers to generate and encode (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="synthetic KV: seed (default: %(default)s)")
    parser.add_argument("--targets", nargs="+", choices=[t.value for t in Target],
                        default=[Target.INT8.value, Target.EXACT.value],
                        help="what Anchor+Residual reconstruct (default: %(default)s)")
    parser.add_argument("--anchor-bits", type=int, default=_DEFAULT.anchor_bits,
                        help="default: %(default)s")
    parser.add_argument("--group-size", type=int, default=_DEFAULT.group_size,
                        help="default: %(default)s")
    parser.add_argument("--k-grouping", choices=[g.value for g in KGrouping],
                        default=KGrouping(_DEFAULT.k_grouping).value,
                        help="K scale/zero groups (default: %(default)s)")
    parser.add_argument("--sink-tokens", type=int, default=_DEFAULT.sink_tokens,
                        help="default: %(default)s")
    parser.add_argument("--recent-tokens", type=int, default=_DEFAULT.recent_tokens,
                        help="default: %(default)s")
    parser.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=_DEFAULT.rotate,
                        help="Hadamard rotation before quantizing (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=256,
                        help="tokens per wire chunk (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the report here (default: out/codec_report_<model>.json)")


def build_report(args: argparse.Namespace) -> Report:
    try:
        shape = model_shape(args.model)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"--model: {exc}") from None
    kv = args.kv or ("real" if shape.name == REAL_MODEL else "synthetic")
    if kv == "real" and shape.name != REAL_MODEL:
        raise SystemExit(f"--kv real needs --model {REAL_MODEL}: the embedded {EMBEDDED_NAME} is "
                         f"the only model whose KV this tool computes; use --kv synthetic")
    specs = [CodecSpec(anchor_bits=args.anchor_bits, group_size=args.group_size, target=target,
                       k_grouping=args.k_grouping, sink_tokens=args.sink_tokens,
                       recent_tokens=args.recent_tokens, rotate=args.rotate)
             for target in dict.fromkeys(args.targets)]
    sample = (real_kv(shape, args.prompts, args.prompt_tokens) if kv == "real"
              else synthetic_kv(shape, args.tokens, args.sample_layers, args.seed))
    log.info("sample KV: %s", sample.description)
    sums = [TargetSums(spec) for spec in specs]
    for seq, layer, kind, x in sample.runs():
        for target in sums:
            target.add(seq, layer, kind, x, args.chunk_tokens)
    layers, g = shape.num_layers, args.group_size
    reference = {
        "bf16": float(shape.with_dtype(torch.bfloat16).bytes_per_token()),
        "int8": quantized_nbytes_per_token(8, shape.num_kv_heads, shape.head_dim, g) * layers,
        "int4": quantized_nbytes_per_token(4, shape.num_kv_heads, shape.head_dim, g) * layers,
    }
    return Report(
        model=shape.name, layers=layers, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        kv=sample.kind, kv_description=sample.description, sequence_tokens=sample.sequence_tokens,
        layers_measured=sample.layers, chunk_tokens=args.chunk_tokens,
        reference_bytes_per_token=reference,
        reference_ratio_to_bf16={k: v / reference["bf16"] for k, v in reference.items()},
        targets=[t.report(shape) for t in sums],
    )


# ----------------------------------------------------------------------------------- printing


def _spec_line(spec: dict) -> str:
    return (f"anchor {spec['anchor_bits']} bits, group {spec['group_size']}, K per "
            f"{spec['k_grouping']}, rotate {'on' if spec['rotate'] else 'off'}, sink "
            f"{spec['sink_tokens']}, recent {spec['recent_tokens']}")


def format_report(report: Report) -> str:
    lines = [f"Lynx codec report — {report.model} ({report.layers} layers, {report.kv_heads} KV "
             f"heads x {report.head_dim}, bf16)",
             f"KV: {report.kv_description}",
             f"wire bytes per token for the whole model, chunks of {report.chunk_tokens} tokens, "
             "headers included",
             "",
             f"{'reference KV':<22}{'bytes/token':>12}{'÷ BF16':>9}"]
    for name, value in report.reference_bytes_per_token.items():
        lines.append(f"{name.upper() + ' KV':<22}{value:>12,.0f}"
                     f"{report.reference_ratio_to_bf16[name]:>9.3f}")
    cols = ("Anchor", "Residual", "total", "ideal")
    for t in report.targets:
        lines += ["", f"target {t.target} ({_spec_line(t.spec)})",
                  f"{'':<6}{'':>2}{' bytes/token ':-^40}{'':>2}{' ÷ BF16 ':-^36}",
                  f"{'':<8}" + "".join(f"{c:>10}" for c in cols) + "  "
                  + "".join(f"{c:>9}" for c in cols)]
        for name, b in t.bytes_per_token.items():
            r = t.ratio_to_bf16[name]
            ideal_b = "—" if b.ideal is None else f"{b.ideal:,.0f}"
            ideal_r = "—" if r.ideal is None else f"{r.ideal:.3f}"
            lines.append(f"  {name.upper():<6}{b.anchor:>10,.0f}{b.residual:>10,.0f}{b.total:>10,.0f}"
                         f"{ideal_b:>10}  {r.anchor:>9.3f}{r.residual:>9.3f}{r.total:>9.3f}"
                         f"{ideal_r:>9}")
        if t.entropy_bits_per_value is not None:
            spent, h = t.correction_bits_per_value, t.entropy_bits_per_value
            lines.append("  corrections, bits per coded value: ClassRice "
                         + ", ".join(f"{k.upper()} {spent[k]:.2f}" for k in spent)
                         + "; entropy H(c | class) "
                         + ", ".join(f"{k.upper()} {h[k]:.2f}" for k in h)
                         + f"; raw chunks {t.raw_chunks}")
        lines.append(f"  {'stage':<8}{'rel. RMSE':>12}{'SNR dB':>10}{'max |err|':>12}{'cosine':>10}")
        for stage, stats in (("anchor", t.anchor_error), ("full", t.full_error)):
            snr = "inf" if stats.snr_db is None else f"{stats.snr_db:.2f}"
            lines.append(f"  {stage:<8}{stats.relative_rmse:>12.5f}{snr:>10}"
                         f"{stats.max_abs_error:>12.5f}{stats.cosine_similarity:>10.6f}")
        if t.bit_identical is not None:
            lines.append("  full decode bit-identical to the KV: "
                         + ("yes (0 error)" if t.bit_identical else "NO"))
    return "\n".join(lines)


def report_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2, allow_nan=False) + "\n"


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(format_report(report))
    path = args.json or Path("out") / f"codec_report_{report.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_json(report))
    log.info("wrote %s", path)
    return 0
