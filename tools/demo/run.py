"""`lynx-sglang demo`: the README's main job, a thin composition over `bench-ttft`'s machinery.

Every variant's PD cluster (prefill + decode + router, the embedded SmolLM2-135M, BF16 KV pool)
comes up at once and stays up (`ttft.clusters.start_clusters`); by default (`--regime 4`) the
link between prefill and decode is shaped, as `bench-ttft --regime` does it
(`ttft.regime_run.measure_regime`), so that the BF16 KV's wire time is R × this box's prefill
forward measured just before: the regime where the transfer matters, as for an 8B model's
8k-token prompt on one H100 sending at 5 Gbit/s. `--link RATE` keeps one fixed rate instead
(`ttft.bench.run_interleaved`); without root the link is loopback and the demo says so. The
requests go to the variants interleaved round by round, so the variants share the box's drifts in
speed. The baseline (the first variant, `mooncake-nospin`) waits in SGLang's idle path as Lynx
does, so that its decode does not spin on the prefill's cores, as it would not on separate
machines.

Prints per link (`tools.demo.report`): R and the GPU deployments it stands for, TTFT from the send
and the 16th / 64th token per variant against the baseline, each variant's prefill forward (a
warning when they differ by more than 10 %: the comparison is then not fair), the outputs against
the baseline's (exit status 1 if an exact variant's differ, or a request failed), and the
fast-link case in the README's words. Writes `<out>/demo.json`, `<out>/demo_timeline.png` and the
servers' logs under `<out>/bench_ttft_runs/`; progress and an ETA on stderr (`tools.progress`).
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

from lynx_sglang.errors import LynxError

from ..cluster.netns import netns_available
from ..measure import add_kv_dtype_argument, model_kv_shape
from ..progress import Progress
from ..prompts import passkey_prompt, random_ids_prompts
from ..trace_report import parse_rate
from ..ttft.bench import run_interleaved
from ..ttft.clusters import start_clusters
from ..ttft.regime import CALIBRATION_LINK, parse_regimes, slow_link_variant
from ..ttft.regime_run import measure_regime
from ..ttft.results import BenchConfig
from ..variants import (
    DISABLE_OVERLAP_HELP,
    NO_OVERLAP_SUFFIX,
    VARIANTS,
    Variant,
    VariantError,
    scheduler_note,
    select_variants,
    without_overlap,
)
from .report import (
    FAST_LINK_COMMAND,
    TOKEN_MARKS,
    DemoRun,
    demo_json,
    exit_status,
    format_report,
    plot_timeline,
)

# The headline's three: SGLang's own transfer (without its idle spin), exact Lynx, Lynx's INT8
# target. The first is the baseline.
DEFAULT_VARIANTS = ("mooncake-nospin", "lynx", "lynx-int8")
# R = 4: a 1500-token prompt's BF16 KV takes 4 forwards on the wire (~21 Mbit/s here), where
# the transfer decides the first token (tools/regimes.py: e.g. an 8B model, 8k tokens, one H100
# sending at 5 Gbit/s).
DEFAULT_REGIMES = (4.0,)
# Two requests per variant keep the demo within minutes; bench-ttft takes more for a result.
DEFAULT_REQUESTS = 2
# Host memory one cluster of the embedded model holds (two SGLang servers, their schedulers and
# detokenizers, a router; docs/benchmarks.md: ~5 GiB each). A fresh-clone run on 2026-12-07 lost
# its third cluster's decode to SGLang's "Not enough host memory" beside other work on the box.
CLUSTER_GIB = 5.0


class DemoError(LynxError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", "--backends", dest="variants",
                        default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {[v.name for v in VARIANTS]}, the first the "
                             f"baseline (default {','.join(DEFAULT_VARIANTS)}); --backends is an "
                             "alias. Every cluster is up at once: about 5 GiB each")
    parser.add_argument("--regime", type=parse_regimes, default=None, metavar="R1,R2,…",
                        help="wire-to-forward ratios R to shape the link for, as bench-ttft "
                             "--regime (root): R = the BF16 KV's wire time ÷ the prefill forward "
                             f"measured first (default {','.join(f'{r:g}' for r in DEFAULT_REGIMES)}"
                             f"; `{FAST_LINK_COMMAND}`: the fast-link case)")
    parser.add_argument("--link", default=None, metavar="RATE|none",
                        help="one fixed link rate instead of --regime, e.g. 1gbit (the demo's "
                             "link until 2026-12-07); none = loopback (also what runs without "
                             "root)")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS,
                        help=f"requests per variant and link (default {DEFAULT_REQUESTS})")
    parser.add_argument("--prompt-tokens", type=int, default=1500,
                        help="length of each prompt (default 1500: a forward of a few seconds "
                             "here)")
    parser.add_argument("--max-new-tokens", type=int, default=max(TOKEN_MARKS),
                        help=f"streamed tokens (default {max(TOKEN_MARKS)}, so the "
                             f"{max(TOKEN_MARKS)}th token exists)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the prompts' token ids")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="folder for demo.json, demo_timeline.png and the cluster logs")
    add_kv_dtype_argument(parser)
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help=DISABLE_OVERLAP_HELP + f"; NAME{NO_OVERLAP_SUFFIX} in --variants does "
                             "it for one variant")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=180.0)


def _variants(args: argparse.Namespace) -> list[Variant]:
    try:
        variants = select_variants(args.variants)
    except VariantError as exc:
        raise DemoError(str(exc)) from exc
    if len(variants) < 2:
        raise DemoError("--variants: the demo compares two variants or more")
    if args.disable_overlap_schedule:
        variants = [without_overlap(v, rename=False) for v in variants]
    # Mooncake may take a slow link's whole transfer time; heartbeats queue behind the KV.
    return [slow_link_variant(v, args.request_timeout_s) for v in variants]


def memory_warning(clusters: int, meminfo: Path = Path("/proc/meminfo")) -> str | None:
    """A warning when the host has less memory available than `clusters` clusters hold at
    once (they all stay up); None when enough, or when /proc/meminfo cannot say."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        available_gib = int(fields["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return None
    needed = clusters * CLUSTER_GIB
    if available_gib >= needed:
        return None
    return (f"[demo] warning: {available_gib:.1f} GiB of memory available, {clusters} clusters "
            f"up at once need about {needed:.0f} GiB: one may fail to start (SGLang: \"Not "
            "enough host memory\"); free memory or name fewer --variants")


def _link_desc(link: str | None, kv_dtype: str) -> str:
    where = (f"{link} shaped veth between two network namespaces (prefill | decode)" if link
             else "loopback")
    return f"{where}, {kv_dtype} KV"


def _plan(args: argparse.Namespace) -> tuple[tuple[float, ...], str | None, str]:
    """(the R values to shape for, else the fixed link (None: loopback), and a line saying
    which)."""
    if args.regime is not None and args.link is not None:
        raise DemoError("--regime shapes the link itself; leave out --link (or --regime)")
    if args.link is not None:
        link = None if args.link == "none" else args.link
        return (), link, f"fixed link: {_link_desc(link, args.kv_dtype)}"
    why_not = netns_available()
    if why_not is not None:
        if args.regime is not None:
            raise DemoError(f"--regime needs a shaped link: {why_not}")
        return (), None, (f"loopback: no shaped link ({why_not}), so R is far below 1 (the "
                          "fast-link case); as root the demo shapes the link for R = "
                          f"{DEFAULT_REGIMES[0]:g}")
    rs = args.regime or DEFAULT_REGIMES
    return rs, None, (f"link shaped for R = {', '.join(f'{r:g}' for r in rs)} from a measured "
                      "forward")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..model import embedded_model_dir

    if min(args.requests, args.max_new_tokens, args.prompt_tokens) < 1:
        raise DemoError("--requests, --max-new-tokens and --prompt-tokens must be at least 1")
    variants = _variants(args)
    rs, link, plan = _plan(args)
    model_dir = Path(args.model or embedded_model_dir())
    marks = tuple(k for k in TOKEN_MARKS if k <= args.max_new_tokens)
    cfg = BenchConfig(link, str(model_dir), args.prompt_tokens, args.max_new_tokens,
                      args.requests, args.seed, marks, tuple(v.name for v in variants),
                      variants[0].name, args.startup_timeout_s, args.request_timeout_s,
                      args.kv_dtype, use_bench_serving=False, interleave=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = random_ids_prompts(tokenizer.vocab_size, cfg.prompt_tokens, cfg.max_new_tokens,
                                 cfg.requests, cfg.seed)
    # A full-length warm-up (and calibration) prompt whose prefix no measured prompt shares.
    warmup_ids = passkey_prompt(tokenizer, cfg.prompt_tokens)
    kv_shape = model_kv_shape(model_dir, args.kv_dtype)
    # R is defined on BF16 KV whatever --kv-dtype the servers' pools have.
    kv_bytes = model_kv_shape(model_dir, "bfloat16").bytes_for(cfg.prompt_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] model {model_dir}; {plan}; variants {list(cfg.variants)} (baseline "
          f"{cfg.baseline}), {cfg.requests} request(s) each, interleaved with all clusters up; "
          f"{scheduler_note(variants)}", flush=True)

    warning = memory_warning(len(variants))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    t0, load_start = time.monotonic(), os.getloadavg()
    progress = Progress("demo", len(variants))
    runs: list[DemoRun] = []

    def write(complete: bool) -> None:
        """demo.json so far: written after every link, so a run cut short keeps what it has."""
        extra = {"complete": complete, "cpus": os.cpu_count(), "loadavg_start": load_start,
                 "loadavg_end": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1),
                 "plan": plan, "variant_specs": [asdict(v) for v in variants]}
        (args.out / "demo.json").write_text(json.dumps(demo_json(runs, extra), indent=1))

    try:
        if rs:
            with contextlib.ExitStack() as stack:
                up = start_clusters(stack, variants, replace(cfg, link=CALIBRATION_LINK),
                                    warmup_ids, args.out, progress)
                for r in rs:
                    g = measure_regime(r, up, cfg, prompts=prompts, warmup_ids=warmup_ids,
                                       kv_bytes=kv_bytes, kv_shape=kv_shape, progress=progress)
                    runs.append(DemoRun(_link_desc(g.cfg.link, args.kv_dtype), g.rate.bps,
                                        kv_bytes, g.cfg, g.results, g))
                    write(complete=False)
        else:
            results = run_interleaved(variants, cfg, prompts=prompts, warmup_ids=warmup_ids,
                                      kv_shape=kv_shape, out=args.out, progress=progress)
            runs.append(DemoRun(_link_desc(link, args.kv_dtype), parse_rate(link), kv_bytes,
                                cfg, results))
    except KeyboardInterrupt:
        print("[demo] interrupted; the running clusters were stopped", file=sys.stderr)
        return 130
    write(complete=True)
    print("\n" + format_report(runs))
    plot_timeline(runs, args.out / "demo_timeline.png")
    print(f"\n[demo] wrote {args.out / 'demo.json'} and {args.out / 'demo_timeline.png'} "
          f"({time.monotonic() - t0:.0f} s; load average {load_start[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end, {os.cpu_count()} CPUs)")
    return exit_status(runs)
