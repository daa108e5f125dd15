"""`lynx-sglang bench-ttft` (also `scripts/bench_ttft.py`): time to first token of PD cluster
variants on one shaped link, driven by SGLang's own benchmark client.

In one run, for each variant of `tools.variants.VARIANTS` in turn (by name; each is a KV transfer backend plus
extra server flags), start a local PD cluster (`tools.cluster`: prefill + decode + router,
the link shaped as with `lynx-sglang up --link RATE`), send one full-length warm-up request, then:
  1. `python -m sglang.bench_serving` (through `tools.bench_serving_offline`, see there why)
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
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from lynx_kernels import KVShape
from lynx_sglang.errors import LynxError
from lynx_sglang.names import TIMELINE_ENV, TRACE_DIR_ENV
from lynx_sglang.trace import read_records

from .client import GenerateError, StreamedGeneration, generate, generate_stream
from .cluster import Cluster, ClusterMode, ClusterSpec
from .measure import (
    DEFAULT_KV_DTYPE,
    LYNX_EVENTS,
    add_kv_dtype_argument,
    kv_dtype_server_args,
    metric_samples,
    model_kv_shape,
    wait_for,
)
from .progress import Progress
from .prompts import passkey_prompt, random_ids_prompts
from .trace_report import Breakdown, breakdown, parse_rate, records_by_request
from .variants import VARIANTS, WARMUP_ATTEMPTS, Variant, select_variants, variant_names

BENCH_SERVING = "bench_serving"  # sglang.bench_serving's per-request numbers
LYNX_CLIENT = "lynx_client"      # lynx_tools.client.generate_stream's per-request numbers
CLIENTS = (BENCH_SERVING, LYNX_CLIENT)


class BenchError(LynxError):
    pass


DEFAULT_VARIANTS = ("mooncake", "lynx-int8-nospec", "lynx-int8", "int4-anchor")
# Options that only apply when this tool starts the clusters, with their defaults: argparse's own
# default is None, so that check_arguments can tell whether one was given next to --url.
LAUNCH_DEFAULTS = {"variants": ",".join(DEFAULT_VARIANTS), "baseline": "mooncake",
                   "link": "1gbit", "kv_dtype": DEFAULT_KV_DTYPE, "startup_timeout_s": 300.0,
                   "interleave": False}
# Options that only apply to an already running cluster (--url).
EXTERNAL_OPTIONS = ("label", "metrics_url")
DEFAULT_LABEL = "external"


@dataclass(frozen=True)
class RequestTiming:
    """One request as one client saw it; seconds since that client sent it."""

    client: str
    index: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    # 1-based output token number (the marks, e.g. 16 and 64) -> seconds; None if fewer tokens.
    token_s: dict[int, float | None]
    # lynx_client only: the prefill's "prefill forward done" line, and first token - that.
    prefill_done_s: float | None = None
    network_ttft_s: float | None = None
    # lynx_client, Lynx variants: bytes per stream and Anchor/Residual landed/applied times.
    stream_bytes: dict[str, int] | None = None
    lynx_events_s: dict[str, float | None] = field(default_factory=dict)
    # lynx_client: where the network-exposed TTFT went (tools.trace_report).
    stages: Breakdown | None = None
    text: str = ""


def token_times_from_itl(ttft_s: float, itl_s: list[float], output_tokens: int,
                         marks: tuple[int, ...]) -> dict[int, float | None]:
    """Arrival of output token k from bench_serving's TTFT and per-token inter-token latencies.

    bench_serving spreads each streamed chunk's gap evenly over the chunk's new tokens and keeps
    no ITL for the tokens of the first chunk, so the first `output_tokens - len(itl_s)` tokens
    arrived at TTFT and token k after that at TTFT + the first k - c ITLs (exact at chunk ends;
    with SGLang's default one token per chunk, exact for every token).
    """
    first_chunk = output_tokens - len(itl_s)
    if first_chunk < 1:
        raise BenchError(f"{len(itl_s)} inter-token latencies for {output_tokens} output tokens")
    times: dict[int, float | None] = {}
    for k in marks:
        if k > output_tokens:
            times[k] = None
        elif k <= first_chunk:
            times[k] = ttft_s
        else:
            times[k] = ttft_s + sum(itl_s[:k - first_chunk])
    return times


def parse_bench_serving(result: dict, marks: tuple[int, ...]) -> list[RequestTiming]:
    """Per-request timings from bench_serving's `--output-details` result (one JSONL line)."""
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        raise BenchError(f"bench_serving: {len(errors)} failed request(s): {errors[0][-2000:]}")
    rows = zip(result["input_lens"], result["output_lens"], result["ttfts"], result["itls"],
               result["generated_texts"], strict=True)
    return [RequestTiming(BENCH_SERVING, i, p, o, ttft, token_times_from_itl(ttft, itl, o, marks),
                          text=text)
            for i, (p, o, ttft, itl, text) in enumerate(rows)]


def client_timing(index: int, got: StreamedGeneration, marks: tuple[int, ...],
                  prefill_done: float | None, transfer: dict | None,
                  stages: Breakdown | None = None) -> RequestTiming:
    """Per-request timing of one streamed request, with the prefill's `prefill_done` time and
    (Lynx) the decode's transfer record (bytes per stream, landed/applied times) and its stage
    breakdown."""
    rel = lambda t: None if t is None else round(t - got.t_send, 6)  # noqa: E731
    ttft = rel(got.t_first_token)
    done = rel(prefill_done)
    return RequestTiming(
        LYNX_CLIENT, index, got.prompt_tokens, len(got.output_ids), ttft,
        {k: rel(got.t_tokens[k - 1]) if k <= len(got.t_tokens) else None for k in marks},
        prefill_done_s=done,
        network_ttft_s=None if done is None else round(ttft - done, 6),
        stream_bytes=None if transfer is None else {"anchor": transfer["anchor_bytes"],
                                                    "residual": transfer["residual_bytes"]},
        lynx_events_s={} if transfer is None else {k: rel(transfer.get(k)) for k in LYNX_EVENTS},
        stages=stages, text=got.text)


def metric_values(requests: list[RequestTiming], marks: tuple[int, ...]) -> dict[str, list[float]]:
    """`<client>.<metric>` -> the requests' values (None left out): ttft_s, t<k>_s for each
    token mark k, and for the lynx client (which knows when the prefill's forward ended)
    net_ttft_s, t<k>_from_done_s (token k counted from prefill done: what the issue's goals
    compare, without the prefill's own time) and tpot_s (time per output token between the
    first and the last mark: the decode's pace once the first tokens are out)."""
    out: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(key, []).append(value)

    for r in requests:
        add(f"{r.client}.ttft_s", r.ttft_s)
        if r.client == LYNX_CLIENT:
            add(f"{r.client}.net_ttft_s", r.network_ttft_s)
        for k in marks:
            add(f"{r.client}.t{k}_s", r.token_s.get(k))
        if r.client != LYNX_CLIENT:
            continue
        if r.prefill_done_s is not None:
            for k in marks:
                t = r.token_s.get(k)
                add(f"{r.client}.t{k}_from_done_s", None if t is None else t - r.prefill_done_s)
        first, last = min(marks, default=0), max(marks, default=0)
        t_first, t_last = r.token_s.get(first), r.token_s.get(last)
        if last > first and t_first is not None and t_last is not None:
            add(f"{r.client}.tpot_s", (t_last - t_first) / (last - first))
    return out


def medians(requests: list[RequestTiming], marks: tuple[int, ...]) -> dict[str, float]:
    return {k: round(statistics.median(v), 6) for k, v in metric_values(requests, marks).items()}


def spreads(requests: list[RequestTiming], marks: tuple[int, ...]) -> dict[str, list[float]]:
    """`<client>.<metric>` -> [min, max] over the requests (the medians' spread)."""
    return {k: [round(min(v), 6), round(max(v), 6)]
            for k, v in metric_values(requests, marks).items()}


def same_text_as_baseline(results: list[VariantResult], baseline: str) -> dict[str, bool | None]:
    """Per variant: whether the lynx client got the baseline's text for every prompt (same
    prompts, greedy; a bit-exact variant must). None where either side has no requests."""
    def texts(r: VariantResult) -> list[str]:
        return [q.text for q in sorted(r.requests, key=lambda q: q.index)
                if q.client == LYNX_CLIENT]

    base = next((texts(r) for r in results if r.variant.name == baseline), [])
    out: dict[str, bool | None] = {}
    for r in results:
        if r.variant.name != baseline:
            mine = texts(r)
            out[r.variant.name] = mine == base if mine and base else None
    return out


def ratios(medians_by_variant: dict[str, dict[str, float]], baseline: str) -> dict[str, dict]:
    """`<baseline>/<variant>` -> metric -> baseline median ÷ variant median (> 1: the variant is
    faster). Metrics missing on either side, or zero at the variant, are left out; no ratios
    before the baseline has been measured."""
    if baseline not in medians_by_variant:
        return {}
    base = medians_by_variant[baseline]
    out = {}
    for name, med in medians_by_variant.items():
        if name == baseline:
            continue
        out[f"{baseline}/{name}"] = {k: round(base[k] / med[k], 4) for k in med
                                     if k in base and med[k] > 0}
    return out


@dataclass(frozen=True)
class VariantResult:
    variant: Variant
    requests: list[RequestTiming]
    # Bytes per stream of one request: {"anchor", "residual"} (measured, Lynx) or {"kv"}.
    stream_bytes: dict[str, int]
    bytes_measured: bool
    # Whether both clients got the same text for each prompt (same prompts, greedy); None when
    # bench_serving did not run.
    same_text_both_clients: bool | None
    run_dir: str
    warmup_attempts: int = 1
    # Lynx: the decode's effective configuration as it logged it at start-up.
    server_config: dict | None = None
    # What could not be measured and why (an external cluster's trace records are out of reach).
    unavailable: tuple[str, ...] = ()


def bench_serving_command(url: str, model_dir: Path, prompt_tokens: int, max_new_tokens: int,
                          requests: int, seed: int, output_file: Path,
                          concurrency: int = 1) -> list[str]:
    return [
        sys.executable, "-m", "lynx_tools.bench_serving_offline",
        "--backend", "sglang", "--base-url", url,
        "--model", str(model_dir), "--tokenizer", str(model_dir),
        "--dataset-name", "random-ids", "--tokenize-prompt",
        "--random-input-len", str(prompt_tokens), "--random-output-len", str(max_new_tokens),
        "--random-range-ratio", "1", "--num-prompts", str(requests), "--seed", str(seed),
        # Latency, not throughput: one request at a time unless asked for more. The caller warms
        # the cluster up with a different prompt; bench_serving's own warm-up would send the
        # first measured prompt and put it in the prefix cache.
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--warmup-requests", "0",
        "--output-file", str(output_file), "--output-details", "--disable-tqdm",
    ]


def _flush_prefix_cache(server_url: str, timeout_s: float = 60.0) -> None:
    """Empty a server's prefix cache (waits until it is idle), so a repeated prompt is prefilled
    and transferred in full again. A router passes it on to all its servers."""
    try:
        r = requests.post(f"{server_url}/flush_cache", params={"timeout": f"{timeout_s:.0f}"},
                          timeout=timeout_s + 10)
    except requests.RequestException as exc:
        raise BenchError(f"flush_cache on {server_url} failed: {exc}") from exc
    if r.status_code != 200:
        raise BenchError(f"flush_cache on {server_url}: HTTP {r.status_code}: {r.text[:500]!r}")


def stream_byte_counters(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float] | None:
    """Lynx's `lynx_stream_bytes_total` per stream from a Prometheus `/metrics` page (a decode
    server with SGLang's --enable-metrics), summed over its series; None when the page cannot
    be read or has no such counter (metrics off, not Lynx, or a router's page)."""
    samples = metric_samples(metrics_url, "lynx_stream_bytes_total", timeout_s)
    totals: dict[str, float] = {}
    for sample in samples or ():
        stream = sample.labels.get("stream", "")
        totals[stream] = totals.get(stream, 0.0) + sample.value
    return totals or None


def settled_stream_byte_counters(metrics_url: str, timeout_s: float = 10.0) -> dict | None:
    """`stream_byte_counters` once two reads in a row agree: the decode counts a transfer when
    its KV is final, which with speculation can be a moment after the request's last token."""
    last = [stream_byte_counters(metrics_url)]

    def unchanged() -> bool:
        last.append(stream_byte_counters(metrics_url))
        return last[-1] == last[-2]

    wait_for(unchanged, timeout_s=timeout_s, poll_s=0.5)
    return last[-1]


@dataclass(frozen=True)
class BenchConfig:
    link: str | None
    model: str
    prompt_tokens: int
    max_new_tokens: int
    requests: int
    seed: int
    token_marks: tuple[int, ...]
    variants: tuple[str, ...]
    baseline: str
    startup_timeout_s: float | None  # None for an external cluster
    request_timeout_s: float
    # None for an external cluster: it runs with whatever KV dtype it was started with.
    kv_dtype: str | None = DEFAULT_KV_DTYPE
    # The router of an already running cluster that was measured (--url), instead of variants.
    url: str | None = None
    # False (--no-bench-serving): only this project's streaming client sends requests.
    use_bench_serving: bool = True
    # Requests each client sends at once (--concurrency); 1: one after the other.
    concurrency: int = 1
    # --interleave: all clusters up at once, each round sent to one variant after another.
    interleave: bool = False

    @property
    def pacing(self) -> str:
        pacing = ("one at a time" if self.concurrency == 1 else
                  f"in rounds of {self.concurrency} sent at once")
        return pacing + (", variants interleaved round by round" if self.interleave else "")


def warm_up(url: str, warmup_ids: list[int], cfg: BenchConfig, progress: Progress) -> int:
    """One full-length request; returns the attempt that succeeded."""
    for attempt in range(1, WARMUP_ATTEMPTS + 1):
        progress.note(f"warm-up request ({len(warmup_ids)} tokens), attempt {attempt}")
        try:
            generate(url, input_ids=warmup_ids, max_new_tokens=4, timeout_s=cfg.request_timeout_s)
        except GenerateError as exc:
            progress.note(f"warm-up failed: {exc}")
            if attempt == WARMUP_ATTEMPTS:
                raise
        else:
            return attempt


def run_bench_serving(url: str, name: str, cfg: BenchConfig, run_dir: Path,
                      progress: Progress) -> list[RequestTiming]:
    out_file = run_dir / "bench_serving.jsonl"
    out_file.unlink(missing_ok=True)  # bench_serving appends
    cmd = bench_serving_command(url, Path(cfg.model), cfg.prompt_tokens, cfg.max_new_tokens,
                                cfg.requests, cfg.seed, out_file, cfg.concurrency)
    (run_dir / "bench_serving.cmd").write_text(" ".join(cmd) + "\n")
    progress.note(f"sglang.bench_serving: {cfg.requests} request(s), {cfg.pacing} "
                  f"(log {run_dir / 'bench_serving.log'})")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(run_dir / "bench_serving.log", "wb") as bs_log:
        proc = subprocess.run(cmd, stdout=bs_log, stderr=subprocess.STDOUT, env=env,
                              timeout=cfg.request_timeout_s * cfg.requests + 300)
    if proc.returncode != 0 or not out_file.is_file():
        raise BenchError(f"{name}: bench_serving exited with {proc.returncode}; "
                         f"log {run_dir / 'bench_serving.log'}")
    return parse_bench_serving(json.loads(out_file.read_text().splitlines()[-1]), cfg.token_marks)


def stream_round(url: str, flush_url: str, name: str, round_: list[list[int]], first: int,
                 cfg: BenchConfig) -> tuple[list[StreamedGeneration], list[str]]:
    """One round: `flush_url`'s prefix cache emptied, then the prompts of `round_` (prompt
    numbers from `first`) sent at once with lynx_tools.client; their streams and request
    ids, in prompt order."""
    _flush_prefix_cache(flush_url)
    ids = [f"bench-{name}-{first + j}-{time.time_ns()}" for j in range(len(round_))]
    with ThreadPoolExecutor(len(round_)) as pool:
        futures = [pool.submit(generate_stream, url, input_ids=p,
                               max_new_tokens=cfg.max_new_tokens,
                               timeout_s=cfg.request_timeout_s,
                               sampling={"ignore_eos": True}, rid=rid)
                   for p, rid in zip(round_, ids, strict=True)]
        return [f.result() for f in futures], ids


def stream_prompts(url: str, flush_url: str, name: str, prompts: list[list[int]],
                   cfg: BenchConfig, progress: Progress) -> tuple[list[StreamedGeneration], list[str]]:
    """The prompts in rounds of `cfg.concurrency` sent at once (one at a time by default), each
    round after a flush (`stream_round`); returns the streams and their request ids, in prompt
    order."""
    streamed, rids = [], []
    n = cfg.concurrency
    for start in range(0, len(prompts), n):
        round_ = prompts[start: start + n]
        progress.request(start + len(round_), len(prompts), "(lynx_tools.client)")
        got, ids = stream_round(url, flush_url, name, round_, start, cfg)
        streamed.extend(got)
        rids.extend(ids)
    return streamed, rids


def interleaved_order(names: list[str], rounds: int) -> list[list[str]]:
    """Which variant sends each round first (`--interleave`): the order turns by one each round,
    so that none always goes first, or always right after another, on a box whose speed drifts."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def _same_text(bench: list[RequestTiming], client: list[RequestTiming]) -> bool | None:
    return [b.text for b in bench] == [c.text for c in client] if bench else None


def cluster_spec(variant: Variant, cfg: BenchConfig, run_dir: Path) -> ClusterSpec:
    return ClusterSpec(cfg.model, ClusterMode.PD, variant.transfer_backend, run_dir=run_dir,
                       server_args=variant.server_args + kv_dtype_server_args(cfg.kv_dtype),
                       link=cfg.link, startup_timeout_s=cfg.startup_timeout_s, tls=variant.tls,
                       extra_env={**dict(variant.env), TIMELINE_ENV: "1",
                                  TRACE_DIR_ENV: str(run_dir / "trace")})


@dataclass
class _Measured:
    """What one variant's cluster gave, read while it was still up (`_read_records`)."""

    variant: Variant
    run_dir: Path
    warmup_attempts: int
    bench: list[RequestTiming] = field(default_factory=list)
    streamed: list[StreamedGeneration] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    per_request: list[dict] = field(default_factory=list)
    server_config: dict | None = None


def _read_records(m: _Measured) -> None:
    """The servers' trace records of `m`'s streamed requests (the servers write them
    asynchronously: given a moment), and the decode's effective Lynx configuration."""
    trace_dir = m.run_dir / "trace"
    is_lynx = m.variant.transfer_backend == "lynx"
    needed = ("timeline", "decode", "request") if is_lynx else ("timeline",)
    wait_for(lambda: all(k in records_by_request(trace_dir, rid) for rid in m.rids
                         for k in needed))
    m.per_request = [records_by_request(trace_dir, rid) for rid in m.rids]
    m.server_config = next((r["facts"]["config"] for r in read_records(trace_dir)
                            if r["kind"] == "server" and r["facts"].get("role") == "decode"), None)
    for rid, records in zip(m.rids, m.per_request, strict=True):
        missing = [k for k in needed if k not in records]
        if missing:
            raise BenchError(f"{m.variant.name}: no {missing} trace record for request {rid} in "
                             f"{trace_dir}")


def _result(m: _Measured, cfg: BenchConfig, kv_shape: KVShape) -> VariantResult:
    is_lynx = m.variant.transfer_backend == "lynx"
    rate = parse_rate(cfg.link)
    client = []
    for i, (g, rid, records) in enumerate(zip(m.streamed, m.rids, m.per_request, strict=True)):
        transfer = None
        if is_lynx:
            transfer = dict(records["decode"]["marks"])
            transfer.update(anchor_bytes=records["decode"]["facts"]["anchor_bytes"],
                            residual_bytes=records["decode"]["facts"]["residual_bytes"])
        client.append(client_timing(i, g, cfg.token_marks,
                                    records["timeline"]["marks"]["prefill_done"], transfer,
                                    breakdown(records, rid, g.t_first_token, rate)))
    if is_lynx:
        stream_bytes = lynx_stream_bytes(m.variant.name, [r.stream_bytes for r in client])
    else:
        stream_bytes = {"kv": kv_shape.bytes_for(cfg.prompt_tokens)}
    return VariantResult(m.variant, m.bench + client, stream_bytes, is_lynx,
                         _same_text(m.bench, client), str(m.run_dir), m.warmup_attempts,
                         m.server_config)


def run_variant(variant: Variant, cfg: BenchConfig, *, prompts: list[list[int]],
                warmup_ids: list[int], kv_shape: KVShape, run_dir: Path,
                progress: Progress) -> VariantResult:
    progress.start_variant(variant.name,
                           f"starting cluster: prefill + decode + router (logs {run_dir})")
    t0 = time.monotonic()
    with Cluster(cluster_spec(variant, cfg, run_dir), on_wait=progress.waiting) as cluster:
        progress.note(f"up in {time.monotonic() - t0:.0f} s")
        m = _Measured(variant, run_dir, warm_up(cluster.url, warmup_ids, cfg, progress))
        if cfg.use_bench_serving:
            m.bench = run_bench_serving(cluster.url, variant.name, cfg, run_dir, progress)
        m.streamed, m.rids = stream_prompts(cluster.url, cluster.prefill_url, variant.name,
                                            prompts, cfg, progress)
        _read_records(m)
    progress.finish_variant()
    return _result(m, cfg, kv_shape)


def run_interleaved(variants: list[Variant], cfg: BenchConfig, *, prompts: list[list[int]],
                    warmup_ids: list[int], kv_shape: KVShape, out: Path,
                    progress: Progress) -> list[VariantResult]:
    """`--interleave`: every variant's cluster up at once, then each round of prompts sent to
    one cluster after another (`interleaved_order`), so that the variants share the box's
    drifts in speed instead of each getting its own stretch of time. The clusters that wait
    stay up: each variant runs beside the others' idle servers."""
    with contextlib.ExitStack() as stack:
        # variant name -> what it measured, and its cluster; in the order of `variants`
        up: dict[str, tuple[_Measured, Cluster]] = {}
        for v in variants:
            run_dir = _run_dir(out, v)
            progress.start_variant(v.name, "starting cluster (interleaved: all stay up): "
                                           f"prefill + decode + router (logs {run_dir})")
            cluster = stack.enter_context(
                Cluster(cluster_spec(v, cfg, run_dir), on_wait=progress.waiting))
            up[v.name] = (_Measured(v, run_dir, warm_up(cluster.url, warmup_ids, cfg, progress)),
                          cluster)
            progress.finish_variant()
        progress.phase(f"interleaved, {len(variants)} clusters up")
        n = cfg.concurrency
        starts = range(0, len(prompts), n)
        for start, names in zip(starts, interleaved_order(list(up), len(starts)), strict=True):
            round_ = prompts[start: start + n]
            for name in names:
                m, cluster = up[name]
                progress.note(f"{name}: request {start + len(round_)}/{len(prompts)} "
                              "(lynx_tools.client)")
                got, ids = stream_round(cluster.url, cluster.prefill_url, name, round_, start,
                                        cfg)
                m.streamed.extend(got)
                m.rids.extend(ids)
        for m, _ in up.values():
            _read_records(m)
    return [_result(m, cfg, kv_shape) for m, _ in up.values()]


def _run_dir(out: Path, variant: Variant) -> Path:
    """Where a variant's server logs and trace records go."""
    return (out / "bench_ttft_runs" / variant.name).resolve()


def lynx_stream_bytes(name: str, per_request: list[dict[str, int]]) -> dict[str, int]:
    """One variant's bytes per stream from its same-length requests: the Anchor's size is fixed by
    the prompt length, so requests that differ there mean a bug or mixed settings; an exact
    Residual is as long as each prompt's KV needs (an int8 one is fixed), reported as the
    median."""
    anchors = {b["anchor"] for b in per_request}
    if len(anchors) != 1:
        raise BenchError(f"{name}: Anchor bytes differ between same-length requests: "
                         f"{sorted(anchors)}")
    return {"anchor": anchors.pop(),
            "residual": round(statistics.median(b["residual"] for b in per_request))}


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
                         _same_text(bench, client), str(run_dir), attempt,
                         unavailable=tuple(unavailable))


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def format_table(results: list[VariantResult], cfg: BenchConfig, link_desc: str,
                 ratio_table: dict[str, dict]) -> str:
    marks = cfg.token_marks
    tokens_from = BENCH_SERVING if cfg.use_bench_serving else LYNX_CLIENT
    cols = [(f"{BENCH_SERVING}.ttft_s", "TTFT (bench_serving)"),
            (f"{LYNX_CLIENT}.ttft_s", "TTFT (client)"),
            (f"{LYNX_CLIENT}.net_ttft_s", "net TTFT (client)"),
            *[(f"{tokens_from}.t{k}_s", f"token {k} ({tokens_from})") for k in marks],
            *[(f"{LYNX_CLIENT}.t{k}_from_done_s", f"token {k} from prefill done") for k in marks],
            (f"{LYNX_CLIENT}.tpot_s", f"per token, tokens {min(marks, default=0)}-"
                                      f"{max(marks, default=0)}")]
    # The client's own measures get their spread: the goals compare them, and one shared box
    # varies a lot from request to request.
    spread_of = {f"{LYNX_CLIENT}.net_ttft_s", f"{LYNX_CLIENT}.tpot_s",
                 *[f"{LYNX_CLIENT}.t{k}_from_done_s" for k in marks]}
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    values = [metric_values(r.requests, marks) for r in results]
    # A measure no variant has (bench_serving not run, no prefill line) gets no column.
    cols = [c for c in cols if any(c[0] in vals for vals in values)]
    head = ("variant", *[c[1] for c in cols], "bytes per stream")
    rows = []
    for r, vals in zip(results, values, strict=True):
        cells = [("-" if k not in vals else
                  f"{ms(statistics.median(vals[k]))} ms" if k not in spread_of or len(vals[k]) < 2
                  else f"{ms(statistics.median(vals[k]))} ms ({ms(min(vals[k]))}-{ms(max(vals[k]))})")
                 for k, _ in cols]
        b = r.stream_bytes
        if not b:
            nbytes = "unavailable"
        elif "kv" in b:
            nbytes = f"KV {_mib(b['kv'])} (computed)"
        else:
            nbytes = f"Anchor {_mib(b['anchor'])} / Residual {_mib(b['residual'])}"
        rows.append((r.variant.name, *cells, nbytes))
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))  # noqa: E731
    lines = [f"link: {link_desc}; {cfg.requests} request(s) per client per variant, "
             f"{cfg.pacing}; {cfg.prompt_tokens}-token prompts, {cfg.max_new_tokens} new tokens, "
             "greedy; medians",
             fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    for pair, vals in ratio_table.items():
        shown = ", ".join(f"{k} {v:.2f}" for k, v in vals.items()
                          if k.endswith(("ttft_s", f"t{marks[-1]}_s",
                                         f"t{marks[-1]}_from_done_s")))
        lines.append(f"{pair} (> 1: faster than {cfg.baseline}): {shown}")
    if cfg.use_bench_serving:
        same = {r.variant.name: r.same_text_both_clients for r in results}
        lines.append(f"same output text from both clients (same prompts): {same}")
    same = same_text_as_baseline(results, cfg.baseline)
    if same:
        exact = {r.variant.name: r.variant.exact for r in results}
        lines.append(f"same output text as {cfg.baseline}, prompt by prompt: " + ", ".join(
            f"{name} {ok}" + ("" if exact[name] else " (lossy variant)")
            for name, ok in same.items()))
    lines.append("TTFT: send -> first token at that client; net TTFT: prefill forward done (prefill "
                 "log) -> first token at lynx_tools.client (bench_serving keeps no wall-clock "
                 "send time); token k: send -> k-th streamed token; from prefill done: the same "
                 "minus the prefill's forward; (min-max) over the requests.")
    for r in results:
        if r.unavailable:
            lines.append(f"{r.variant.name}: unavailable for an already running cluster "
                         "(only HTTP reaches it):")
            lines += [f"  - {why}" for why in r.unavailable]
    return "\n".join(lines)


def plot(results: list[VariantResult], cfg: BenchConfig, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The network-exposed TTFT gets its own panel: it is far smaller than the end-to-end times.
    values = [metric_values(r.requests, cfg.token_marks) for r in results]
    # A client that sent nothing (`--no-bench-serving`) gets no empty groups.
    panels = [[f"{LYNX_CLIENT}.net_ttft_s"],
              [k for k in (f"{BENCH_SERVING}.ttft_s", f"{LYNX_CLIENT}.ttft_s",
                           *[f"{c}.t{m}_s" for m in cfg.token_marks for c in CLIENTS],
                           *[f"{LYNX_CLIENT}.t{m}_from_done_s" for m in cfg.token_marks])
               if any(vals.get(k) for vals in values)]]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(panels[1]), 4.5),
                             gridspec_kw={"width_ratios": [1.6, 1.6 * len(panels[1])]})
    width = 0.8 / len(results)
    for ax, keys in zip(axes, panels, strict=True):
        for i, (r, vals) in enumerate(zip(results, values, strict=True)):
            xs = [j + (i - (len(results) - 1) / 2) * width for j in range(len(keys))]
            meds = [statistics.median(vals[k]) if vals.get(k) else 0.0 for k in keys]
            ax.bar(xs, meds, width, label=r.variant.name)
            for x, k in zip(xs, keys, strict=True):  # each request as a dot over its median bar
                ax.plot([x] * len(vals.get(k, [])), vals.get(k, []), "k.", markersize=3)
        ax.set_xticks(range(len(keys)),
                      [k.removesuffix("_s").replace(".", "\n") for k in keys], fontsize=8)
    axes[0].set_ylabel("seconds (median; dots: requests)")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def result_json(results: list[VariantResult], cfg: BenchConfig, link_desc: str,
                ratio_table: dict[str, dict], extra: dict) -> dict:
    same = same_text_as_baseline(results, cfg.baseline)
    return {
        "config": asdict(cfg) | {"link_desc": link_desc,
                                 "variant_specs": [asdict(r.variant) for r in results]} | extra,
        "variants": {r.variant.name: {
            "stream_bytes": r.stream_bytes, "bytes_measured": r.bytes_measured,
            "same_text_both_clients": r.same_text_both_clients, "run_dir": r.run_dir,
            "warmup_attempts": r.warmup_attempts, "server_config": r.server_config,
            "unavailable": list(r.unavailable),
            "medians": medians(r.requests, cfg.token_marks),
            "spreads": spreads(r.requests, cfg.token_marks),
            "same_text_as_baseline": same.get(r.variant.name),
            "requests": {c: [asdict(q) for q in r.requests if q.client == c] for c in CLIENTS},
        } for r in results},
        "ratios": ratio_table,
    }


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
    add_kv_dtype_argument(launch, default=None)
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

    from .model import embedded_model_dir

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
    print(f"[bench-ttft] model {model_dir}; link: {link_desc}; variants {list(cfg.variants)}",
          flush=True)

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
                                  "lynx_tools.bench_serving_offline)"
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
                run_dir = _run_dir(args.out, v)
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
