"""How `lynx-sglang bench-ttft` (tools/ttft/bench.py) sends its requests to one router: SGLang's
own `sglang.bench_serving` (through `tools.ttft.bench_serving_offline`) and this project's streaming
client (`tools.client`), a warm-up first, the prefix cache flushed between rounds; and Lynx's
byte counters read from a decode's /metrics. Returns each request's `RequestTiming`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

from ..client import GenerateError, StreamedGeneration, generate, generate_stream
from ..measure import metric_samples, wait_for
from ..progress import Progress
from ..variants import WARMUP_ATTEMPTS
from .results import BenchConfig, BenchError, RequestTiming, parse_bench_serving


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """A RAG-like request set (bench_serving's generated-shared-prefix dataset): `docs` documents
    of `doc_tokens` tokens, each followed by `questions_per_doc` different questions of
    `question_tokens` tokens, in a seeded shuffled order; every question after a document's first
    finds the document in the prefill's prefix cache."""

    docs: int
    questions_per_doc: int
    doc_tokens: int
    question_tokens: int

    @property
    def requests(self) -> int:
        return self.docs * self.questions_per_doc

    def dataset_args(self, max_new_tokens: int) -> list[str]:
        return ["--dataset-name", "generated-shared-prefix", "--tokenize-prompt",
                "--gsp-num-groups", str(self.docs),
                "--gsp-prompts-per-group", str(self.questions_per_doc),
                "--gsp-system-prompt-len", str(self.doc_tokens),
                "--gsp-question-len", str(self.question_tokens),
                "--gsp-output-len", str(max_new_tokens), "--gsp-range-ratio", "1"]


def bench_serving_command(url: str, model_dir: Path, prompt_tokens: int, max_new_tokens: int,
                          requests: int, seed: int, output_file: Path,
                          concurrency: int = 1, *, request_rate: float = float("inf"),
                          range_ratio: float = 1.0,
                          shared_prefix: SharedPrefixWorkload | None = None) -> list[str]:
    """`request_rate` (requests/s, Poisson arrivals; inf: all at once, up to `concurrency`) and
    `range_ratio` (prompt lengths uniform in [range_ratio, 1] x `prompt_tokens`) as
    bench_serving takes them; the defaults are bench-ttft's: latency, every prompt full length.
    With `shared_prefix` the prompts are that workload's instead (`prompt_tokens`, `range_ratio`
    and `requests` then come from it)."""
    if shared_prefix is None:
        dataset = ["--dataset-name", "random-ids", "--tokenize-prompt",
                   "--random-input-len", str(prompt_tokens),
                   "--random-output-len", str(max_new_tokens),
                   "--random-range-ratio", f"{range_ratio:g}"]
    else:
        dataset = shared_prefix.dataset_args(max_new_tokens)
        requests = shared_prefix.requests
    return [
        sys.executable, "-m", "lynx_tools.ttft.bench_serving_offline",
        "--backend", "sglang", "--base-url", url,
        "--model", str(model_dir), "--tokenizer", str(model_dir),
        *dataset, "--num-prompts", str(requests),
        "--seed", str(seed),
        # Latency, not throughput: one request at a time unless asked for more. The caller warms
        # the cluster up with a different prompt; bench_serving's own warm-up would send the
        # first measured prompt and put it in the prefix cache.
        "--max-concurrency", str(concurrency), "--request-rate", f"{request_rate:g}",
        "--warmup-requests", "0",
        "--output-file", str(output_file), "--output-details", "--disable-tqdm",
    ]


def flush_prefix_cache(server_url: str, timeout_s: float = 60.0) -> None:
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


def bench_serving_record(cmd: list[str], out_file: Path, log_path: Path, timeout_s: float,
                         what: str) -> dict:
    """Run one `sglang.bench_serving` command (offline: the model is local) with its output to
    `log_path`, and return the result record it appended to `out_file`; BenchError naming `what`
    and the log if it failed or wrote none."""
    out_file.unlink(missing_ok=True)  # bench_serving appends
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log_path, "wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s)
    if proc.returncode != 0 or not out_file.is_file():
        raise BenchError(f"{what}: bench_serving exited with {proc.returncode}; log {log_path}")
    return json.loads(out_file.read_text().splitlines()[-1])


def run_bench_serving(url: str, name: str, cfg: BenchConfig, run_dir: Path,
                      progress: Progress) -> list[RequestTiming]:
    out_file = run_dir / "bench_serving.jsonl"
    cmd = bench_serving_command(url, Path(cfg.model), cfg.prompt_tokens, cfg.max_new_tokens,
                                cfg.requests, cfg.seed, out_file, cfg.concurrency)
    (run_dir / "bench_serving.cmd").write_text(" ".join(cmd) + "\n")
    progress.note(f"sglang.bench_serving: {cfg.requests} request(s), {cfg.pacing} "
                  f"(log {run_dir / 'bench_serving.log'})")
    record = bench_serving_record(cmd, out_file, run_dir / "bench_serving.log",
                                  cfg.request_timeout_s * cfg.requests + 300, name)
    return parse_bench_serving(record, cfg.token_marks)


def stream_round_outcomes(url: str, flush_url: str, name: str, round_: list[list[int]],
                          first: int, cfg: BenchConfig,
                          ) -> tuple[list[StreamedGeneration | GenerateError], list[str]]:
    """One round: `flush_url`'s prefix cache emptied, then the prompts of `round_` (prompt
    numbers from `first`) sent at once with lynx_tools.client; each one's stream, or the
    GenerateError it failed with, and the request ids, in prompt order."""
    flush_prefix_cache(flush_url)
    ids = [f"bench-{name}-{first + j}-{time.time_ns()}" for j in range(len(round_))]
    with ThreadPoolExecutor(len(round_)) as pool:
        futures = [pool.submit(generate_stream, url, input_ids=p,
                               max_new_tokens=cfg.max_new_tokens,
                               timeout_s=cfg.request_timeout_s,
                               sampling={"ignore_eos": True}, rid=rid)
                   for p, rid in zip(round_, ids, strict=True)]
        return [_outcome(f) for f in futures], ids


def _outcome(future) -> StreamedGeneration | GenerateError:
    """A request's stream, or the GenerateError it failed with (anything else is raised)."""
    try:
        return future.result()
    except GenerateError as exc:
        return exc


def stream_round(url: str, flush_url: str, name: str, round_: list[list[int]], first: int,
                 cfg: BenchConfig) -> tuple[list[StreamedGeneration], list[str]]:
    """`stream_round_outcomes` where every request must succeed: the first failure raised."""
    outcomes, ids = stream_round_outcomes(url, flush_url, name, round_, first, cfg)
    for o in outcomes:
        if isinstance(o, GenerateError):
            raise o
    return outcomes, ids


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

