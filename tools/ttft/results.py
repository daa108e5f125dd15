"""The numbers of `lynx-sglang bench-ttft` (tools/ttft/bench.py): each request as a client saw
it (`RequestTiming`, from SGLang's bench_serving or this project's streaming client), a variant's
requests (`VariantResult`), the run's settings (`BenchConfig`), and their statistics: medians,
[min, max] spreads, baseline ÷ variant ratios, whether outputs equal the baseline's. Pure data
and arithmetic; the report (`tools.ttft.report`) formats it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from lynx_sglang.errors import LynxError

from ..client import StreamedGeneration
from ..measure import DEFAULT_KV_DTYPE, LYNX_EVENTS
from ..trace_report import Breakdown
from ..variants import Variant

BENCH_SERVING = "bench_serving"  # sglang.bench_serving's per-request numbers


LYNX_CLIENT = "lynx_client"      # lynx_tools.client.generate_stream's per-request numbers


CLIENTS = (BENCH_SERVING, LYNX_CLIENT)


class BenchError(LynxError):
    pass


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
    # lynx_client, Lynx variants: the width of the request's Anchor (`--lynx-anchor-width`).
    anchor_bits: int | None = None
    lynx_events_s: dict[str, float | None] = field(default_factory=dict)
    # lynx_client: where the network-exposed TTFT went (tools.trace_report).
    stages: Breakdown | None = None
    # lynx_client, speculative Lynx: speculated / accepted / rolled_back tokens of its
    # verification (the decode's `spec` record); None without one.
    speculation: dict[str, int] | None = None
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
                  stages: Breakdown | None = None,
                  speculation: dict[str, int] | None = None) -> RequestTiming:
    """Per-request timing of one streamed request, with the prefill's `prefill_done` time and
    (Lynx) the decode's transfer record (bytes per stream, landed/applied times), its stage
    breakdown and its speculation outcome."""
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
        anchor_bits=None if transfer is None else transfer.get("anchor_bits"),
        lynx_events_s={} if transfer is None else {k: rel(transfer.get(k)) for k in LYNX_EVENTS},
        stages=stages, speculation=speculation, text=got.text)


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
    """Per variant: whether the lynx client got the baseline's text for every prompt both have
    (same prompts, greedy; a bit-exact variant must; a failed request has none). None where they
    have no prompt in common."""
    def texts(r: VariantResult) -> dict[int, str]:
        return {q.index: q.text for q in r.requests if q.client == LYNX_CLIENT}

    base = next((texts(r) for r in results if r.variant.name == baseline), {})
    out: dict[str, bool | None] = {}
    for r in results:
        if r.variant.name != baseline:
            mine = texts(r)
            common = mine.keys() & base.keys()
            out[r.variant.name] = all(mine[i] == base[i] for i in common) if common else None
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
    # Requests that failed, left out of every figure: {"prompt", "rid", "error"}.
    failed: tuple[dict, ...] = ()


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
    # CPUs of each role's servers (`ClusterSpec.role_cpus`); empty: unpinned.
    role_cpus: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def pacing(self) -> str:
        pacing = ("one at a time" if self.concurrency == 1 else
                  f"in rounds of {self.concurrency} sent at once")
        return pacing + (", variants interleaved round by round" if self.interleave else "")

