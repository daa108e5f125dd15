"""`lynx-sglang plan`: predict a deployment's TTFT P50/P99, time per output token and SLO goodput
for mooncake, Lynx exact and Lynx int8 (`tools.plan.model`), or with `--validate` check the model
against this box's stored bench-ttft and bench-load results (`tools.plan.validate`). Registered
in tools/cli.py; writes `--json PATH`, prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

from .model import (
    GPUS,
    PLAN_VARIANTS,
    PRESETS,
    DecodeStep,
    Deployment,
    ForwardTime,
    ModelShape,
    PlanError,
    Prediction,
    Slo,
)
from .predict import predict

RESULTS = Path(__file__).resolve().parents[2] / "results"
# `--examples`: the GPU deployments results/plan/gpu_predictions.json holds (RAG-like prompts of
# 6-10k tokens, 256 output tokens; the prefix cache is not modelled).
EXAMPLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Llama-3-8B, H100 prefills, 2 per decode, 100 Gbit/s RDMA",
     ("--model", "Llama-3-8B", "--gpu", "H100", "--prompt-range", "6000,10000", "--rate", "1",
      "--prefills-per-decode", "2", "--link-gbps", "100")),
    ("Llama-3-8B, H100 prefills, 2 per decode, 25 Gbit/s",
     ("--model", "Llama-3-8B", "--gpu", "H100", "--prompt-range", "6000,10000", "--rate", "1",
      "--prefills-per-decode", "2", "--link-gbps", "25")),
    ("Llama-3-8B, H100, 1 prefill per decode, 10 Gbit/s TCP",
     ("--model", "Llama-3-8B", "--gpu", "H100", "--prompt-range", "6000,10000", "--rate", "1",
      "--link-gbps", "10")),
    ("Llama-3-70B, 4xH100 (TP 4), 1 prefill per decode, 25 Gbit/s",
     ("--model", "Llama-3-70B", "--gpu", "H100", "--gpus", "4", "--prompt-range", "6000,10000",
      "--rate", "0.5", "--link-gbps", "25")),
)
# GPU codec throughput assumed where none was measured: the goal for the exact coder,
# half a device copy (a copy reads and writes each byte).
GPU_CODEC_SHARE_OF_COPY = 0.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.epilog = ("Example: lynx-sglang plan --model Llama-3-8B --gpu H100 --prompt-tokens 8000 "
                "--rate 0.5 --link-gbps 25. Predictions, not measurements: the GPU's forward and "
                "decode step are estimates from FLOPs and HBM bytes; the codec, verification and "
                "acceptance costs are this box's (results/).")
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=sorted(PRESETS), help="a preset model shape")
    m.add_argument("--layers", type=int, help="layers (instead of --model)")
    m.add_argument("--kv-heads", type=int, help="KV heads (instead of --model)")
    m.add_argument("--head-dim", type=int, help="head dim (instead of --model)")
    m.add_argument("--params", type=float, help="parameters, for the GPU estimates")
    m.add_argument("--q-heads", type=int, help="query heads, for the GPU forward estimate")
    w = p.add_argument_group("workload")
    w.add_argument("--prompt-tokens", type=int, default=8000, help="every prompt's length")
    w.add_argument("--prompt-range", metavar="LO,HI",
                   help="prompt lengths uniform in LO..HI instead of --prompt-tokens")
    w.add_argument("--output-tokens", type=int, default=256, help="tokens generated per request")
    w.add_argument("--rate", type=float, default=0.5, help="Poisson requests/s into EACH prefill")
    d = p.add_argument_group("deployment")
    d.add_argument("--link-gbps", type=float, default=100.0,
                   help="the decode's ingress in Gbit/s, shared by the prefills that feed it")
    d.add_argument("--prefills-per-decode", type=int, default=1)
    d.add_argument("--forward-s", type=float,
                   help="measured prefill forward in seconds at --prompt-tokens (the mean prompt "
                        "with --prompt-range), scaled linearly; else estimated from --gpu")
    d.add_argument("--gpu", choices=sorted(GPUS), default="H100",
                   help="GPU for the forward/decode estimates")
    d.add_argument("--gpus", type=int, default=1, help="GPUs per prefill and per decode (TP)")
    d.add_argument("--mfu", type=float, default=0.4, help="prefill model FLOPs utilisation")
    d.add_argument("--hbm-efficiency", type=float, default=0.6,
                   help="share of HBM bandwidth a decode step achieves")
    d.add_argument("--decode-step-ms", type=float,
                   help="measured decode step (ms) instead of the HBM estimate")
    d.add_argument("--fixed-ms", type=float, default=20.0,
                   help="send -> first token beyond forward and wire (bootstrap, first step, "
                        "client); an assumption on GPUs (this box: ~21 ms, results/plan)")
    s = p.add_argument_group("SLO and run")
    s.add_argument("--slo-ttft-s", type=float,
                   help="TTFT bound (default: 3 x the mean forward, as bench-load's)")
    s.add_argument("--slo-tpot-ms", type=float, help="optional time-per-output-token bound")
    s.add_argument("--slo-target", type=float, default=0.9,
                   help="share of requests within the SLO that meets it")
    s.add_argument("--requests", type=int, default=20000, help="simulated requests per variant")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", type=Path, metavar="PATH", help="write the prediction as JSON")
    s.add_argument("--validate", action="store_true",
                   help="instead: run the model with every stored bench-ttft/bench-load run's "
                        "parameters and compare (writes --json, default "
                        "results/plan/validation.json)")
    s.add_argument("--examples", action="store_true",
                   help="instead: predict the built-in GPU deployments (EXAMPLES) and print their "
                        "README rows (writes --json, default results/plan/gpu_predictions.json)")
    s.add_argument("--results", type=Path, default=RESULTS, help="the stored results folder")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.validate or args.examples:
        return
    custom = [args.layers, args.kv_heads, args.head_dim]
    if args.model is None and None in custom:
        p.error("give --model, or all of --layers, --kv-heads and --head-dim")
    if args.model is not None and any(v is not None for v in custom):
        p.error("--model excludes --layers/--kv-heads/--head-dim")
    for name in ("rate", "link_gbps", "forward_s", "decode_step_ms", "fixed_ms", "slo_ttft_s",
                 "slo_tpot_ms"):
        value = getattr(args, name)
        if value is not None and value < 0:
            p.error(f"--{name.replace('_', '-')} must not be negative, got {value:g}")
    if args.link_gbps == 0:
        p.error("--link-gbps must be positive")
    if args.prompt_range:
        try:
            lo, hi = (int(x) for x in args.prompt_range.split(","))
        except ValueError:
            p.error(f"--prompt-range wants LO,HI, got {args.prompt_range!r}")
        if not 1 <= lo <= hi:
            p.error(f"--prompt-range wants 1 <= LO <= HI, got {lo},{hi}")
    if args.requests < 100:
        p.error("--requests must be >= 100")
    if not 0 < args.slo_target <= 1:
        p.error("--slo-target must be in (0, 1]")


def build(args: argparse.Namespace) -> tuple[Deployment, Slo, str]:
    """The deployment, its SLO and a line saying where the forward and the step came from."""
    from .box import read_box_costs

    if args.model:
        shape = PRESETS[args.model]
    else:
        shape = ModelShape("custom", args.layers, args.kv_heads, args.head_dim, args.params,
                           args.q_heads)
    if args.prompt_range:
        lo, hi = (int(x) for x in args.prompt_range.split(","))
        prompts = tuple(range(lo, hi + 1, max(1, (hi - lo) // 1000)))
    else:
        prompts = (args.prompt_tokens,)
    gpu = GPUS[args.gpu]
    mean_tokens = round(statistics.fmean(prompts))
    if args.forward_s is not None:
        forward = ForwardTime.measured(args.forward_s, mean_tokens)
        source = f"forward {args.forward_s:g} s at {mean_tokens} tokens (given)"
    else:
        forward = ForwardTime.from_gpu(shape, gpu, args.gpus, args.mfu)
        source = (f"forward estimated: {args.gpus}x{gpu.name} at MFU {args.mfu:g} "
                  f"({forward.seconds(mean_tokens):.3g} s at {mean_tokens} tokens)")
    if args.decode_step_ms is not None:
        decode = DecodeStep(args.decode_step_ms / 1000)
        source += f"; decode step {args.decode_step_ms:g} ms (given)"
    else:
        decode = DecodeStep.from_gpu(shape, gpu, args.gpus, args.hbm_efficiency)
        source += (f"; decode step estimated from {args.gpus}x{gpu.name} HBM at "
                   f"{args.hbm_efficiency:g} ({decode.base_s * 1e3:.3g} ms + the batch's KV)")
    codec_s_per_byte = 2 / (GPU_CODEC_SHARE_OF_COPY * args.gpus * gpu.hbm_bytes_per_s)
    costs = replace(read_box_costs(args.results).stage_costs(), fixed_s=args.fixed_ms / 1000,
                    encode_exact_s_per_byte=codec_s_per_byte,
                    encode_int8_s_per_byte=codec_s_per_byte,
                    apply_exact_s_per_byte=codec_s_per_byte,
                    apply_int8_s_per_byte=codec_s_per_byte)
    dep = Deployment(shape, prompts, (args.output_tokens,), args.rate, args.link_gbps * 1e9,
                     args.prefills_per_decode, forward, decode, costs)
    mean_f = statistics.fmean(forward.seconds(t) for t in prompts)
    slo = Slo(args.slo_ttft_s if args.slo_ttft_s is not None else 3 * mean_f,
              None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000, args.slo_target)
    return dep, slo, source


def _s(x: float | None, fmt: str = "{:.3g} s") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3g} ms"


def format_prediction(dep: Deployment, slo: Slo, source: str, pred: Prediction) -> str:
    mean_t = statistics.fmean(dep.prompts)
    mean_f = statistics.fmean(dep.forward.seconds(t) for t in dep.prompts)
    r = dep.wire_s(round(mean_t), 1.0) / mean_f
    lines = [
        f"PREDICTION (a model, not a measurement): {dep.shape.name} ({dep.shape.layers} layers, "
        f"{dep.shape.kv_heads} KV heads x {dep.shape.head_dim}: "
        f"{dep.shape.kv_bytes_per_token / 1024:.0f} KiB BF16 KV per token)",
        f"prompts {min(dep.prompts)}-{max(dep.prompts)} tokens (mean {mean_t:.0f}), "
        f"{dep.outputs[0]} output tokens, {dep.rate:g} req/s into each of "
        f"{dep.prefills_per_decode} prefill(s) per decode, link {dep.link_bps / 1e9:g} Gbit/s",
        source,
        f"R = BF16 wire / forward = {r:.3g}; prefill busy {pred.prefill_utilisation:.2f}; decode "
        f"step at the steady batch {pred.decode_step_s * 1e3:.3g} ms; SLO TTFT <= "
        f"{slo.ttft_s:.3g} s" + (f", TPOT <= {slo.tpot_s * 1e3:.3g} ms" if slo.tpot_s else "")
        + f" for {slo.target:.0%} of requests",
        "",
        f"{'variant':<10} {'link busy':>9} {'TTFT P50':>9} {'TTFT P99':>9} {'mean P-K':>9} "
        f"{'TPOT':>8} {'e2e P99':>9} {'in SLO':>7} {'goodput':>11} {'max rate/prefill':>17}",
    ]
    for v in pred.variants:
        if not v.stable:
            lines.append(f"{v.variant:<10} {v.link_utilisation:>9.2f}  {v.reason}")
            continue
        lines.append(
            f"{v.variant:<10} {v.link_utilisation:>9.2f} {_s(v.ttft_p50_s):>9} "
            f"{_s(v.ttft_p99_s):>9} {_s(v.ttft_mean_pk_s):>9} "
            f"{_ms(v.tpot_median_s):>8} "
            f"{_s(v.e2e_p99_s):>9} {v.slo_attainment:>7.0%} {v.goodput_rps:>7.3g} r/s "
            f"{_s(v.max_rate_meeting_slo, '{:.3g} req/s'):>17}")
    return "\n".join(lines)


def prediction_json(dep: Deployment, slo: Slo, source: str, pred: Prediction) -> dict:
    return {"kind": "prediction (model, not measured)", "deployment": asdict(dep) | {
        "prompts": {"min": min(dep.prompts), "max": max(dep.prompts),
                    "mean": statistics.fmean(dep.prompts)}},
            "source": source, "slo": asdict(slo), "prediction": asdict(pred)}


def run(args: argparse.Namespace) -> int:
    if args.validate:
        return _validate(args)
    if args.examples:
        return _examples(args)
    try:
        dep, slo, source = build(args)
        pred = predict(dep, slo, PLAN_VARIANTS, args.requests, args.seed)
    except PlanError as e:  # UnstableError included: the queue that cannot keep up
        print(f"lynx-sglang plan: {e}", file=sys.stderr)
        return 2
    print(format_prediction(dep, slo, source, pred))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(prediction_json(dep, slo, source, pred), indent=1) + "\n")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from .validate import TOLERANCE, validate

    result, box = validate(args.results)
    doc = result.to_json(box)
    path = args.json or args.results / "plan" / "validation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'split / ablation':<38} {'source':<11} {'metric':<14} {'n':>3} {'median |err|':>13} "
          f"{f'within {TOLERANCE:.0%}':>11} {'low':>4}")
    tables = [("validation", doc["summary_validation"]),
              ("calibration", doc["summary_calibration"]),
              *((f"validation, {name}", rows) for name, rows in doc["ablations"].items())]
    for name, rows in tables:
        for row in rows:
            print(f"{name:<38} {row['source']:<11} {row['metric']:<14} {row['n']:>3} "
                  f"{row['median_abs_rel_error']:>13.1%} {row['within_tolerance']:>11.0%} "
                  f"{row['predicted_low']:>4}")
    print(f"wrote {path} (per variant: its summary; every residual; known misses)")
    return 0


def _cell(v) -> str:
    if not v.stable:
        return f"unstable (link {v.link_utilisation:.2f} busy)"
    return f"{v.ttft_p50_s:.2f} / {v.ttft_p99_s:.2f} s"


def readme_row(label: str, dep: Deployment, slo: Slo, pred: Prediction) -> str:
    """One "where Lynx pays" row: TTFT P50 / P99 per variant, and each one's goodput at the
    rate and highest rate meeting the SLO."""
    by = {v.variant: v for v in pred.variants}
    mean_t = round(statistics.fmean(dep.prompts))
    mean_f = statistics.fmean(dep.forward.seconds(t) for t in dep.prompts)
    r = dep.wire_s(mean_t, 1.0) / mean_f
    good = " / ".join("-" if not v.stable else
                      f"{v.slo_attainment:.0%}, max {_s(v.max_rate_meeting_slo, '{:.2g}')}"
                      for v in (by["mooncake"], by["lynx"], by["lynx-int8"]))
    return (f"| {label} (**prediction**) | {r:.2g} | {dep.decode_rate:g} req/s | "
            f"{_cell(by['mooncake'])} | {_cell(by['lynx'])} | {_cell(by['lynx-int8'])} | "
            f"{_ms(by['lynx'].tpot_median_s)} | TTFT <= {slo.ttft_s:.2g} s: {good} |")


README_HEAD = ("| deployment | R | rate into a decode | mooncake TTFT P50 / P99 | Lynx exact | "
               "Lynx int8 | Lynx TPOT | SLO met (mooncake / exact / int8), max req/s per prefill "
               "|\n|---|---|---|---|---|---|---|---|")


def _examples(args: argparse.Namespace) -> int:
    rows, docs = [], []
    for label, argv in EXAMPLES:
        p = argparse.ArgumentParser()
        add_arguments(p)
        ex = p.parse_args([*argv, "--requests", str(args.requests), "--seed", str(args.seed),
                           "--results", str(args.results)])
        check_arguments(p, ex)
        dep, slo, source = build(ex)
        pred = predict(dep, slo, PLAN_VARIANTS, ex.requests, ex.seed)
        print(f"== {label}\n{format_prediction(dep, slo, source, pred)}\n")
        rows.append(readme_row(label, dep, slo, pred))
        docs.append({"label": label, "argv": list(argv),
                     **prediction_json(dep, slo, source, pred)})
    path = args.json or args.results / "plan" / "gpu_predictions.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": "predictions (model, not measured)",
                                "readme_rows": [README_HEAD, *rows], "deployments": docs},
                               indent=1) + "\n")
    print("\n".join([README_HEAD, *rows]))
    print(f"wrote {path}")
    return 0
