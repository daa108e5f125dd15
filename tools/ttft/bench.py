"""`lynx-sglang bench-ttft` (also `scripts/bench_ttft.py`): time to first token of PD cluster
variants on one shaped link, driven by SGLang's own benchmark client.

In one run, for each variant of `tools.variants.VARIANTS` in turn (by name; each is a KV transfer backend plus
extra server flags), start a local PD cluster (`tools.cluster.local`: prefill + decode + router,
the link shaped as with `lynx-sglang up --link RATE`), send one full-length warm-up request, then:
  1. `python -m sglang.bench_serving` (through `tools.ttft.bench_serving_offline`, see there why)
     against the router: `--backend sglang --dataset-name random-ids --tokenize-prompt` with
     `--random-range-ratio 1`, so every prompt is exactly `--prompt-tokens` token ids and nothing
     is read from the network; `--max-concurrency 1`, requests one after the other. Its own TTFT
     and inter-token latencies per request give TTFT and the time to the 16th/64th token.
  2. The same prompts again with this project's streaming client (`tools.client`), one at a
     time, the prefill's prefix cache flushed before each: bench_serving keeps no wall-clock send
     time, and the network-exposed TTFT (the prefill's `prefill_done` timeline line ->
     first token at the client) needs one. Also TTFT and the 16th/64th token times.
`--concurrency N` sends the prompts in rounds of N at once instead (bench_serving's
`--max-concurrency N`; the streaming client flushes the prefix cache before each round): the
prefill batches a round into one forward, which is how a loaded server sends several requests'
KV at once.
Every server's KV pool has `--kv-dtype` (default BF16, SGLang's `--kv-cache-dtype`; the model
computes in fp32). Bytes per stream: Lynx variants from the decode's `lynx transfer` line of each
request; mooncake from the model's KV shape in that dtype (computed). Greedy, `ignore_eos`
(bench_serving's default), so every request streams exactly `--max-new-tokens` tokens.

`--no-bench-serving` leaves out step 1.

`--interleave` (with `--no-bench-serving`) starts every variant's cluster first and keeps them all
up, then sends each round of step 2 to one variant after another, the first turning each round.
Measured one whole variant after another, each variant gets its own stretch of a box whose speed
drifts within the hour (this CPU box's, by up to 3x); interleaved, they share the same conditions.

`--regime R1,R2,…` runs the variants interleaved at each wire-to-forward ratio R instead of one
link rate: the link re-shaped per R from a measured forward (`tools.ttft.regime` for the rate and
the report, `tools.ttft.regime_run` for the run, `tools.regimes` for the GPU deployments each R
stands for).

Every server runs SGLang's default overlap scheduler (`--disable-overlap-schedule`: none does;
`--variants NAME@no-overlap`: that variant does not, beside the others); a Lynx prefill streams
its KV layer by layer under either; the configuration line says which variant ran which.

`--url ROUTER` measures an already running cluster instead, as one variant (`--label`): the same
warm-up and steps 1 and 2 through that router (its /flush_cache reaches every server). What needs
the servers' trace files (net TTFT, Lynx's stream times, the stage breakdown) is reported as
unavailable; bytes per stream come from Lynx's counters on `--metrics-url`'s /metrics when it has
them.

Writes `<out>/bench_ttft.json` (config, per-variant per-request numbers of both clients, medians
and [min, max] spreads, whether the outputs equal the baseline's prompt by prompt, baseline ÷
variant ratios of the medians), `<out>/bench_ttft.png` (bar plot of the medians) and the
servers' and bench_serving's logs under `<out>/bench_ttft_runs/<variant>/`. Progress (variant i/N,
start-up waits, request j/M, an ETA) goes to stderr (`tools.progress`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from lynx_kernels import KVShape

from ..cluster.local import Cluster
from ..measure import (
    DEFAULT_KV_DTYPE,
    add_kv_dtype_argument,
    model_kv_shape,
)
from ..progress import Progress
from ..prompts import passkey_prompt, random_ids_prompts
from ..variants import (
    DISABLE_OVERLAP_HELP,
    NO_OVERLAP_SUFFIX,
    VARIANTS,
    Variant,
    scheduler_note,
    select_variants,
    variant_names,
    without_overlap,
)
from .clients import (
    run_bench_serving,
    settled_stream_byte_counters,
    stream_prompts,
    warm_up,
)
from .clusters import (
    Measured,
    cluster_spec,
    read_traces,
    run_dir_of,
    same_text,
    send_interleaved,
    start_clusters,
    variant_result,
)

# Re-exported: tests/sglang/test_bench_ttft_report.py imports these two from here.
from .clusters import interleaved_order as interleaved_order
from .clusters import lynx_stream_bytes as lynx_stream_bytes
from .regime import REGIME_HELP, check_regime_arguments, parse_regimes
from .regime_run import run_regimes
from .report import format_table, plot, result_json
from .results import (
    BenchConfig,
    BenchError,
    VariantResult,
    client_timing,
    medians,
    ratios,
)

DEFAULT_VARIANTS = ("mooncake", "lynx-int8-nospec", "lynx-int8", "int4-anchor")
# Options that only apply when this tool starts the clusters, with their defaults: argparse's own
# default is None, so that check_arguments can tell whether one was given next to --url.
LAUNCH_DEFAULTS = {"variants": ",".join(DEFAULT_VARIANTS), "baseline": "mooncake",
                   "link": "1gbit", "kv_dtype": DEFAULT_KV_DTYPE, "startup_timeout_s": 300.0,
                   "interleave": False, "regime": None, "disable_overlap_schedule": False}
# Options that only apply to an already running cluster (--url).
EXTERNAL_OPTIONS = ("label", "metrics_url")
DEFAULT_LABEL = "external"

def run_variant(variant: Variant, cfg: BenchConfig, *, prompts: list[list[int]],
                warmup_ids: list[int], kv_shape: KVShape, run_dir: Path,
                progress: Progress) -> VariantResult:
    progress.start_variant(variant.name,
                           f"starting cluster: prefill + decode + router (logs {run_dir})")
    t0 = time.monotonic()
    with Cluster(cluster_spec(variant, cfg, run_dir), on_wait=progress.waiting) as cluster:
        progress.note(f"up in {time.monotonic() - t0:.0f} s")
        m = Measured(variant, run_dir, warm_up(cluster.url, warmup_ids, cfg, progress))
        if cfg.use_bench_serving:
            m.bench = run_bench_serving(cluster.url, variant.name, cfg, run_dir, progress)
        m.streamed, m.rids = stream_prompts(cluster.url, cluster.prefill_url, variant.name,
                                            prompts, cfg, progress)
        m.prompts = list(range(len(m.streamed)))
        read_traces(m)
    progress.finish_variant()
    return variant_result(m, cfg, kv_shape)


def run_interleaved(variants: list[Variant], cfg: BenchConfig, *, prompts: list[list[int]],
                    warmup_ids: list[int], kv_shape: KVShape, out: Path,
                    progress: Progress) -> list[VariantResult]:
    """`--interleave`: every variant's cluster up at once, then each round of prompts sent to
    one cluster after another (`interleaved_order`), so that the variants share the box's
    drifts in speed instead of each getting its own stretch of time. The clusters that wait
    stay up: each variant runs beside the others' idle servers."""
    with contextlib.ExitStack() as stack:
        up = start_clusters(stack, variants, cfg, warmup_ids, out, progress)
        progress.phase(f"interleaved, {len(variants)} clusters up")
        send_interleaved(up, prompts, cfg, progress)
        for m, _ in up.values():
            read_traces(m)
    return [variant_result(m, cfg, kv_shape) for m, _ in up.values()]


def external_variant(label: str, url: str) -> Variant:
    return Variant(label, "unknown", description=f"an already running cluster at {url}")


def run_external(variant: Variant, cfg: BenchConfig, *, prompts: list[list[int]],
                 warmup_ids: list[int], metrics_url: str, run_dir: Path,
                 progress: Progress) -> VariantResult:
    """The same requests against an already running cluster (`cfg.url`, its router). Only what
    HTTP gives is measured: the clients' times, and bytes per stream when `metrics_url`'s
    /metrics counts Lynx's streams; the servers' trace records are files on their machines."""
    url = cfg.url
    run_dir.mkdir(parents=True, exist_ok=True)
    progress.start_variant(variant.name, f"measuring the running cluster at {url}")
    attempt = warm_up(url, warmup_ids, cfg, progress)
    bench = (run_bench_serving(url, variant.name, cfg, run_dir, progress)
             if cfg.use_bench_serving else [])
    # Read with no request in flight: the counters grow by exactly the streamed requests' bytes.
    before = settled_stream_byte_counters(metrics_url)
    streamed, _ = stream_prompts(url, url, variant.name, prompts, cfg, progress)
    after = settled_stream_byte_counters(metrics_url)
    unavailable = [
        "net TTFT (prefill forward done -> first token): needs the prefill's trace records",
        "Lynx stream times (Anchor/Residual landed, applied) and the stage breakdown of the "
        "net TTFT: need the decode's trace records",
        "the decode's Lynx configuration: from its trace records",
    ]
    stream_bytes: dict[str, int] = {}
    if before is not None and after is not None:
        stream_bytes = {k: round((after[k] - before.get(k, 0.0)) / len(prompts)) for k in after}
    else:
        unavailable.append(f"bytes per stream: {metrics_url}/metrics has no lynx_stream_bytes_total "
                           "(give the decode's URL with --metrics-url; it needs SGLang's "
                           "--enable-metrics)")
    client = [client_timing(i, g, cfg.token_marks, None, None) for i, g in enumerate(streamed)]
    progress.finish_variant()
    return VariantResult(variant, bench + client, stream_bytes, bool(stream_bytes),
                         same_text(bench, client), str(run_dir), attempt,
                         unavailable=tuple(unavailable))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group(
        "clusters this tool starts, one per variant (not with --url)")
    launch.add_argument("--variants", default=None,
                        help=f"comma-separated, from {[v.name for v in VARIANTS]} "
                             f"(default {LAUNCH_DEFAULTS['variants']})")
    launch.add_argument("--baseline", default=None,
                        help=f"variant the ratios divide by (default {LAUNCH_DEFAULTS['baseline']})")
    launch.add_argument("--link", default=None, metavar="RATE|none",
                        help="rate of the shaped link between prefill and decode (two network "
                             "namespaces; root), e.g. 1gbit, 10mbit; none = loopback (default "
                             f"{LAUNCH_DEFAULTS['link']})")
    launch.add_argument("--regime", type=parse_regimes, default=None, metavar="R1,R2,…",
                        help=REGIME_HELP)
    add_kv_dtype_argument(launch, default=None)
    launch.add_argument("--disable-overlap-schedule", action="store_true", default=None,
                        help=DISABLE_OVERLAP_HELP + f"; NAME{NO_OVERLAP_SUFFIX} in --variants "
                             "does it for one variant, to compare both in one run")
    launch.add_argument("--startup-timeout-s", type=float, default=None,
                        help="seconds each cluster may take to come up (default "
                             f"{LAUNCH_DEFAULTS['startup_timeout_s']:.0f})")
    external = parser.add_argument_group("an already running cluster")
    external.add_argument("--url", default=None,
                          help="measure the cluster behind this router URL (e.g. "
                               "http://10.0.0.5:30000) instead of starting clusters: the same "
                               "requests, the clients' TTFT and token times as one variant; the "
                               "net TTFT and Lynx's stream times need the servers' trace files "
                               "and are reported as unavailable")
    external.add_argument("--label", default=None,
                          help=f"name of that variant in the results (default {DEFAULT_LABEL})")
    external.add_argument("--metrics-url", default=None, metavar="URL",
                          help="a server whose /metrics counts Lynx's stream bytes (the decode, "
                               "started with SGLang's --enable-metrics), for bytes per stream "
                               "(default: the --url itself)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3,
                        help="requests per client per variant (default 3), sent one at a time unless "
                             "--concurrency says otherwise")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="send each client's requests in rounds of this many at once, which "
                             "the prefill batches into one forward (default 1: one at a time)")
    launch.add_argument("--interleave", action="store_true", default=None,
                        help="start every variant's cluster at once and send each round of "
                             "prompts to one variant after another (the first turning each "
                             "round), instead of one variant's requests after another's: on a "
                             "box whose speed drifts, compares the variants on equal terms. "
                             "Needs --no-bench-serving and two variants or more; memory for "
                             "all the clusters at once (about 6 GiB each with the embedded model)")
    parser.add_argument("--token-marks", default="16,64",
                        help="report the time to these streamed tokens (default 16,64)")
    parser.add_argument("--seed", type=int, default=42, help="bench_serving's --seed (prompts)")
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model folder (default: the embedded SmolLM2-135M); with --url "
                             "only its tokenizer is read, so it must be the served model's")
    parser.add_argument("--no-bench-serving", dest="use_bench_serving", action="store_false",
                        help="send only lynx_tools.client's requests, no sglang.bench_serving "
                             "pass (half the requests; its token times then come from the client)")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="folder for bench_ttft.json, bench_ttft.png and bench_ttft_runs/")
    parser.add_argument("--request-timeout-s", type=float, default=300.0)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--url excludes the options of the clusters this tool starts, and they need it for theirs;
    then fill in the launch defaults (see LAUNCH_DEFAULTS)."""
    launch = [_flag(k) for k in LAUNCH_DEFAULTS if getattr(args, k) is not None]
    external = [_flag(k) for k in EXTERNAL_OPTIONS if getattr(args, k) is not None]
    if args.url is not None:
        if launch:
            parser.error(f"--url measures an already running cluster; {', '.join(launch)}: only "
                         "for the clusters bench-ttft starts itself")
        args.label = args.label or DEFAULT_LABEL
        args.metrics_url = args.metrics_url or args.url
        return
    if external:
        parser.error(f"{', '.join(external)}: only with --url (an already running cluster)")
    check_regime_arguments(parser, args)
    for k, default in LAUNCH_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, default)
    if args.interleave and args.use_bench_serving:
        parser.error("--interleave needs --no-bench-serving: sglang.bench_serving sends all its "
                     "requests to one cluster, it cannot take turns")
    if args.interleave and len(variant_names(args.variants)) < 2:
        parser.error("--interleave needs two variants or more")


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from ..model import embedded_model_dir

    if args.requests < 1 or args.max_new_tokens < 1 or args.concurrency < 1:
        raise BenchError("--requests, --max-new-tokens and --concurrency must be at least 1")
    url = args.url.rstrip("/") if args.url else None
    if url:
        variants = [external_variant(args.label, url)]
        link, baseline = None, args.label
        link_desc = f"already running cluster at {url} (link and KV dtype as it was started)"
    else:
        variants = select_variants(args.variants)
        if args.baseline not in [v.name for v in variants]:
            raise BenchError(f"--baseline {args.baseline} is not among --variants")
        if args.disable_overlap_schedule:
            variants = [without_overlap(v, rename=False) for v in variants]
        link, baseline = (None if args.link == "none" else args.link), args.baseline
        link_desc = (f"{link} shaped veth between two network namespaces (prefill | decode)"
                     if link else "loopback") + f", {args.kv_dtype} KV"
    model_dir = Path(args.model or embedded_model_dir())
    cfg = BenchConfig(link, str(model_dir), args.prompt_tokens, args.max_new_tokens,
                      args.requests, args.seed,
                      tuple(int(k) for k in args.token_marks.split(",") if k.strip()),
                      tuple(v.name for v in variants), baseline, args.startup_timeout_s,
                      args.request_timeout_s, args.kv_dtype, url, args.use_bench_serving,
                      args.concurrency, bool(args.interleave))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = random_ids_prompts(tokenizer.vocab_size, cfg.prompt_tokens, cfg.max_new_tokens,
                                 cfg.requests, cfg.seed)
    # A full-length warm-up whose prefix no measured prompt shares.
    warmup_ids = passkey_prompt(tokenizer, cfg.prompt_tokens)
    # An external cluster's KV dtype is its own; --model may then hold only a tokenizer.
    kv_shape = None if url else model_kv_shape(model_dir, args.kv_dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.regime:
        return run_regimes(args.regime, variants, cfg, prompts=prompts, warmup_ids=warmup_ids,
                           model_dir=model_dir, kv_shape=kv_shape, out=args.out)
    print(f"[bench-ttft] model {model_dir}; link: {link_desc}; variants {list(cfg.variants)}"
          + ("" if url else f"; {scheduler_note(variants)}"), flush=True)

    t0 = time.monotonic()
    load_start = os.getloadavg()
    results: list[VariantResult] = []
    progress = Progress("bench-ttft", len(variants))

    def write(complete: bool) -> dict:
        """The JSON so far: written after every variant, so a run cut short keeps what it has."""
        ratio_table = ratios({r.variant.name: medians(r.requests, cfg.token_marks)
                              for r in results}, cfg.baseline)
        extra = {"complete": complete, "cpus": os.cpu_count(), "loadavg_start": load_start,
                 "loadavg_end": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1),
                 "bench_serving": "sglang.bench_serving --backend sglang --dataset-name random-ids "
                                  "--tokenize-prompt --random-range-ratio 1 --max-concurrency "
                                  f"{cfg.concurrency} --warmup-requests 0 (via "
                                  "lynx_tools.ttft.bench_serving_offline)"
                                  if cfg.use_bench_serving else "not run (--no-bench-serving)"}
        (args.out / "bench_ttft.json").write_text(
            json.dumps(result_json(results, cfg, link_desc, ratio_table, extra), indent=1))
        return ratio_table

    try:
        if cfg.interleave:
            results.extend(run_interleaved(variants, cfg, prompts=prompts, warmup_ids=warmup_ids,
                                           kv_shape=kv_shape, out=args.out, progress=progress))
        else:
            for v in variants:
                run_dir = run_dir_of(args.out, v)
                if url:
                    results.append(run_external(v, cfg, prompts=prompts, warmup_ids=warmup_ids,
                                                metrics_url=args.metrics_url.rstrip("/"),
                                                run_dir=run_dir, progress=progress))
                else:
                    results.append(run_variant(v, cfg, prompts=prompts, warmup_ids=warmup_ids,
                                               kv_shape=kv_shape, run_dir=run_dir,
                                               progress=progress))
                write(complete=False)
    except KeyboardInterrupt:
        print("[bench-ttft] interrupted" + ("" if url else "; the running cluster was stopped"),
              file=sys.stderr)
        return 130
    ratio_table = write(complete=True)
    print()
    print(format_table(results, cfg, link_desc, ratio_table))
    plot(results, cfg, args.out / "bench_ttft.png",
         f"{cfg.prompt_tokens}-token prompts, {cfg.max_new_tokens} new tokens, {link_desc}")
    print(f"\n[bench-ttft] wrote {args.out / 'bench_ttft.json'} and {args.out / 'bench_ttft.png'} "
          f"({time.monotonic() - t0:.0f} s)")
    return 0
