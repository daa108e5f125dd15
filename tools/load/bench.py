"""`lynx-sglang bench-load` (also `scripts/bench_load.py`): PD cluster variants under Poisson
arrivals, as a serving engineer sizes a deployment: P50/P99 TTFT, time per output token,
throughput and SLO attainment per arrival rate.

Every variant's cluster is started once and kept up (`tools.ttft.clusters.start_clusters`, as
`bench-ttft --interleave`); the link between prefill and decode is shaped to a wire-to-forward
ratio R (`--regime`, from a forward measured on the baseline as `bench-ttft --regime` does) or to
a fixed `--link` rate. Then for each `--rates` value, each variant in turn (the first turning per
rate, `ttft.clusters.interleaved_order`): the prefix cache flushed, and `sglang.bench_serving`
(through `tools.ttft.bench_serving_offline`) sends `--requests` random-id prompts of
`--range-ratio`..1 × `--prompt-tokens` tokens at Poisson arrivals of that rate, no concurrency
cap, the same seed for every variant (the same prompts at the same moments). The figures are
`tools.load.stats`'; the SLO is TTFT ≤ `--slo-ttft-s` (default 3 × the measured forward) for
`--slo-target` of the requests.

Writes `<out>/bench_load.json` (after every pass, so a run cut short keeps what it has),
`<out>/bench_load.png` (P99 TTFT and SLO attainment per rate) and the servers' and
bench_serving's logs under `<out>/bench_ttft_runs/<variant>/`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from ..cluster.local import Cluster
from ..cluster.process_tree import tree_cpu_s
from ..cluster.spec import split_cpus
from ..measure import add_kv_dtype_argument, model_kv_shape
from ..progress import Progress
from ..prompts import passkey_prompt
from ..ttft.clients import (
    SharedPrefixWorkload,
    bench_serving_command,
    bench_serving_record,
    flush_prefix_cache,
)
from ..ttft.clusters import interleaved_order, run_dir_of, start_clusters
from ..ttft.regime import CALIBRATION_LINK, link_rate_for, slow_link_variant
from ..ttft.regime_run import calibrate, shape_links
from ..ttft.results import BenchConfig
from ..variants import select_variants, variant_names
from .stats import LoadPass, LoadReport

JSON_NAME = "bench_load.json"
DEFAULT_VARIANTS = "mooncake-nospin,lynx"
# The SLO bound by default, in measured forwards: a request whose KV crosses a link at R = 1
# right after its forward answers in about 2 forwards; the third is the queueing a loaded
# deployment allows itself.
SLO_FORWARDS = 3.0


def parse_rates(text: str) -> tuple[float, ...]:
    """`--rates`' argparse type: positive requests per second, run in ascending order."""
    try:
        rates = tuple(sorted(float(x) for x in text.split(",") if x.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every rate must be a positive number: {text!r}")
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated variants, all kept up at once (default "
                             f"{DEFAULT_VARIANTS}; about 6 GiB each with the embedded model)")
    parser.add_argument("--baseline", default=None,
                        help="variant the ratios divide by (default the first)")
    parser.add_argument("--rates", type=parse_rates, default=(0.05, 0.1), metavar="R1,R2,…",
                        help="Poisson arrival rates in requests/s (default 0.05,0.1: on 2 CPU "
                             "cores a 1000-token forward takes 2-4 s)")
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--regime", type=float, default=None, metavar="R",
                      help="shape the link so that a --prompt-tokens prompt's BF16 KV takes R x "
                           "the measured forward on the wire (default 1)")
    link.add_argument("--link", default=None, metavar="RATE",
                      help="a fixed link rate instead (e.g. 100mbit)")
    parser.add_argument("--requests", type=int, default=10, help="requests per rate and variant")
    parser.add_argument("--prompt-tokens", type=int, default=1000,
                        help="longest prompt (default 1000)")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="prompt lengths uniform in [ratio, 1] x --prompt-tokens "
                             "(bench_serving's --random-range-ratio; default 0.5)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-s", type=float, default=None,
                        help=f"TTFT bound of the SLO (default {SLO_FORWARDS:g} x the forward "
                             "measured at the start)")
    parser.add_argument("--slo-target", type=float, default=0.9,
                        help="share of requests within the bound that meets the SLO (default 0.9)")
    parser.add_argument("--seed", type=int, default=42, help="bench_serving's --seed")
    parser.add_argument("--workload", choices=("random", "rag"), default="random",
                        help="random: independent random-id prompts (default); rag: documents "
                             "of --prompt-tokens tokens each asked several short questions "
                             "(bench_serving's generated-shared-prefix dataset, shuffled with "
                             "--seed): every question after a document's first finds it in the "
                             "prefill's prefix cache, as RAG serving sends them")
    parser.add_argument("--rag-docs", type=int, default=4, help="rag: documents (default 4)")
    parser.add_argument("--rag-questions-per-doc", type=int, default=4,
                        help="rag: questions per document (default 4); the requests per pass "
                             "are documents x questions (--requests is not used)")
    parser.add_argument("--rag-question-tokens", type=int, default=32,
                        help="rag: tokens per question (default 32)")
    parser.add_argument("--pin-roles", action="store_true",
                        help="run every prefill on the first half of this box's CPUs and every "
                             "decode on the other half (taskset), as separate machines would: "
                             "otherwise one role's work (the prefill's encode and next forward) "
                             "takes cores from the other's decode steps")
    add_kv_dtype_argument(parser)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--request-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("out/bench_load"))


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.workload == "rag":
        if min(args.rag_docs, args.rag_questions_per_doc, args.rag_question_tokens) < 1:
            parser.error("--rag-docs, --rag-questions-per-doc and --rag-question-tokens must be "
                         "at least 1")
        args.requests = args.rag_docs * args.rag_questions_per_doc
    if args.requests < 2 or args.max_new_tokens < 2:
        parser.error("--requests and --max-new-tokens must be at least 2 (a P99 and a time per "
                     "output token need them)")
    if not 0 < args.range_ratio <= 1 or not 0 < args.slo_target <= 1:
        parser.error("--range-ratio and --slo-target must be in (0, 1]")
    if args.regime is not None and args.regime <= 0:
        parser.error("--regime must be positive")
    if args.regime is None and args.link is None:
        args.regime = 1.0
    args.baseline = args.baseline or variant_names(args.variants)[0]
    if args.baseline not in variant_names(args.variants):
        parser.error(f"--baseline {args.baseline} is not among --variants")


def run_pass(cluster: Cluster, variant: str, rate: float, cfg: BenchConfig, run_dir: Path,
             range_ratio: float, shared_prefix: SharedPrefixWorkload | None = None) -> LoadPass:
    """One bench_serving pass of Poisson arrivals at `rate` against `cluster`."""
    flush_prefix_cache(cluster.prefill_url)
    out_file = run_dir / f"bench_load_{rate:g}.jsonl"
    cmd = bench_serving_command(cluster.url, Path(cfg.model), cfg.prompt_tokens,
                                cfg.max_new_tokens, cfg.requests, cfg.seed, out_file,
                                concurrency=cfg.requests, request_rate=rate,
                                range_ratio=range_ratio, shared_prefix=shared_prefix)
    cpu_before = _role_cpu_s(cluster)
    record = bench_serving_record(cmd, out_file, run_dir / f"bench_load_{rate:g}.log",
                                  cfg.request_timeout_s * cfg.requests + 300,
                                  f"{variant} at {rate:g} req/s")
    cpu_after = _role_cpu_s(cluster)
    return replace(LoadPass.from_bench_serving(variant, rate, record),
                   cpu_s={role: round(cpu_after[role] - cpu_before[role], 3)
                          for role in cpu_before})


def _role_cpu_s(cluster: Cluster) -> dict[str, float]:
    """CPU seconds each role's server trees have used so far."""
    return {role: tree_cpu_s(cluster.proc(role)) for role in ("prefill", "decode")}


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..model import embedded_model_dir

    variants = [slow_link_variant(v, args.request_timeout_s)
                for v in select_variants(args.variants)]
    model_dir = embedded_model_dir()
    link = args.link or CALIBRATION_LINK
    cfg = BenchConfig(link, str(model_dir), args.prompt_tokens, args.max_new_tokens,
                      args.requests, args.seed, (), tuple(v.name for v in variants),
                      args.baseline, args.startup_timeout_s, args.request_timeout_s,
                      args.kv_dtype, interleave=True,
                      role_cpus=split_cpus() if args.pin_roles else {})
    shared_prefix = None
    if args.workload == "rag":
        shared_prefix = SharedPrefixWorkload(args.rag_docs, args.rag_questions_per_doc,
                                             args.prompt_tokens, args.rag_question_tokens)
    warmup_ids = passkey_prompt(AutoTokenizer.from_pretrained(str(model_dir)), args.prompt_tokens)
    kv_bytes = model_kv_shape(model_dir, "bfloat16").bytes_for(args.prompt_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    progress = Progress("bench-load", len(variants))
    t0, load_start = time.monotonic(), os.getloadavg()
    doc: dict = {"variants": list(cfg.variants), "rates": list(args.rates),
                 "requests_per_pass": args.requests, "prompt_tokens": args.prompt_tokens,
                 "range_ratio": args.range_ratio, "max_new_tokens": args.max_new_tokens,
                 "workload": (asdict(shared_prefix) | {"kind": "rag"} if shared_prefix
                              else {"kind": "random"}),
                 "kv_dtype": args.kv_dtype, "kv_bf16_bytes_longest_prompt": kv_bytes,
                 "cpus": os.cpu_count(), "role_cpus": cfg.role_cpus,
                 "loadavg_start": load_start}
    report: LoadReport | None = None

    def write(complete: bool) -> None:
        doc.update(complete=complete, loadavg_end=os.getloadavg(),
                   wall_s=round(time.monotonic() - t0, 1))
        if report is not None:
            doc["report"] = report.to_json()
        (args.out / JSON_NAME).write_text(json.dumps(doc, indent=1))

    try:
        with contextlib.ExitStack() as stack:
            up = start_clusters(stack, variants, cfg, warmup_ids, args.out, progress)
            base, base_cluster = up[args.baseline]
            shape_links(up, CALIBRATION_LINK)
            calibration = calibrate(base, base_cluster, warmup_ids, replace(cfg, link=link))
            forward_s = calibration.forward_s
            if args.regime is not None:
                shaped = link_rate_for(args.regime, kv_bytes, forward_s)
                link = shaped.tc
                doc["link"] = {"regime": args.regime, "tc": shaped.tc, "bps": shaped.bps,
                               "describe": shaped.describe()}
            else:
                doc["link"] = {"tc": link}
            shape_links(up, link)
            slo = args.slo_ttft_s or round(SLO_FORWARDS * forward_s, 3)
            doc["forward_s"] = {"fastest": forward_s, "samples": list(calibration.samples_s)}
            report = LoadReport(args.baseline, slo, args.slo_target)
            print(f"[bench-load] forward {forward_s:.2f} s; link {link}; SLO TTFT <= {slo:.2f} s "
                  f"for {args.slo_target:.0%}; rates {list(args.rates)} req/s, "
                  f"{args.requests} requests each", flush=True)
            for rate, names in zip(args.rates, interleaved_order(list(up), len(args.rates)),
                                   strict=True):
                for name in names:
                    m, cluster = up[name]
                    progress.note(f"{name}: {args.requests} requests at {rate:g}/s")
                    report.passes.append(run_pass(cluster, name, rate, cfg,
                                                  run_dir_of(args.out, m.variant),
                                                  args.range_ratio, shared_prefix))
                    write(complete=False)
    except KeyboardInterrupt:
        print("[bench-load] interrupted; the running clusters were stopped", file=sys.stderr)
        write(complete=False)
        return 130
    write(complete=True)
    print("\n" + report.table())
    _plot(report, args.out / "bench_load.png", doc["link"])
    print(f"\n[bench-load] wrote {args.out / JSON_NAME} and {args.out / 'bench_load.png'} "
          f"({time.monotonic() - t0:.0f} s)")
    return 0


def _plot(report: LoadReport, path: Path, link: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    by_variant: dict[str, list] = {}
    for f in report.figures():
        by_variant.setdefault(f.variant, []).append(f)
    for name, figs in by_variant.items():
        figs.sort(key=lambda f: f.rate)
        ax1.plot([f.rate for f in figs], [f.ttft_p99_s for f in figs], "o-", label=name)
        ax2.plot([f.rate for f in figs], [f.slo_attainment for f in figs], "o-", label=name)
    ax1.axhline(report.slo_ttft_s, color="grey", linestyle=":", label="SLO bound")
    ax1.set(xlabel="arrival rate (req/s)", ylabel="P99 TTFT (s)", title="P99 TTFT")
    ax2.set(xlabel="arrival rate (req/s)", ylabel="share within the bound",
            title="SLO attainment", ylim=(0, 1.05))
    ax1.legend()
    regime = f"R {link['regime']:g}, " if "regime" in link else ""
    fig.suptitle(f"Poisson arrivals; {regime}link {link.get('describe') or link.get('tc')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
