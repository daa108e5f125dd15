"""`lynx-sglang load`: many concurrent requests through a real PD cluster (several prefill servers,
one decode, SGLang's router), some of them abandoned by their client mid-stream, and every greedy
answer that completed checked token for token against a single server's.

What one round checks (`LoadReport`): no request that was not abandoned failed; each completed
output equals the single server's for its prompt (a request that got another request's KV or
tokens would not); afterwards the decode holds no KV slots beyond its idle baseline and no server
holds Lynx staging memory or per-request map entries (`lynx_staging_used_bytes`,
`lynx_tracked_requests` on every /metrics page). `--duration-s`
repeats rounds until the time is up (a soak). Exit status 1 if any round found a problem.

The mix (`mix.KINDS`, `--kinds`): greedy requests, greedy ones asking for logprobs,
temperature, top-p/top-k/min-p, penalized and regex-constrained ones, in turn (shifted on each
pass over the prompt lengths). Deterministic kinds are checked token for token; sampled and
penalized ones for completing (see `RequestKind.exact`). Each round also
reports, per kind, how many of the requests the decode committed at Anchor time were allowed to
speculate and why the others waited (`mix.SpecTally`, from the decode's `lynx spec` lines):
on loopback most Residuals land first, so `--hold-residual-s` holds each one back (the prefill's
fault-injection knob) to give every request the chance.

The reference runs on a single server with the radix cache off, one request at a time; the PD
cluster batches the same prompts together. On this CPU the model computes in fp32 and SGLang's
torch-native attention works per request, so batching does not change greedy tokens here; a
mismatch that also appears with `--transfer-backend mooncake_tcp` is batch numerics, not Lynx.
Both clusters run SGLang's default overlap scheduler, what a loaded deployment runs, unless
`--disable-overlap-schedule`: the scheduler changes when a step's results are processed, not a
forward's numbers, so the check needs no deterministic scheduling, only the same one on both sides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV

from ..client import GenerateError, generate, generate_stream
from ..cluster.local import Cluster
from ..cluster.process_tree import Resources
from ..cluster.spec import TRANSFER_BACKENDS, ClusterMode, ClusterSpec, sglang_pd_timeouts_env
from ..measure import add_kv_dtype_argument, all_zero, kv_dtype_server_args, metric_sum
from ..model import embedded_model_dir
from ..prompts import passkey_prompt
from .mix import (
    KIND_NAMES,
    KINDS,
    RequestKind,
    SpecTally,
    kinds_by_name,
    merged_tallies,
    reference_key,
    request_id,
    speculation_summary,
    tally,
)

logger = logging.getLogger(__name__)

# Prompt lengths of the mix (tokens): short chat turns to RAG-sized contexts.
PROMPT_LENGTHS = (48, 96, 160, 256, 384, 512, 700, 900, 1100, 1300, 1500, 1800)
NEW_TOKENS = (8, 16, 24)
SETTLE_S = 60.0


@dataclass(frozen=True)
class LoadRequest:
    index: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    abandon_after: int | None  # the client closes the stream after this many chunks; None: never
    kind: RequestKind = KINDS[0]


@dataclass
class LoadReport:
    requests: int
    abandoned: int
    completed: int = 0
    mismatches: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leaked_decode_slots: int = 0
    # Per server: None when its /metrics could not be read or lacked the gauge (not clean).
    staging_used_bytes: dict[str, float | None] = field(default_factory=dict)
    tracked_requests: dict[str, float | None] = field(default_factory=dict)
    # Per server after the round settled, and the servers whose threads or fds grew past their
    # values after the first round.
    resources: dict[str, Resources] = field(default_factory=dict)
    grown: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Per request kind: what speculation did with the requests committed at Anchor time.
    speculation: dict[str, SpecTally] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return (not self.mismatches and not self.errors and self.leaked_decode_slots == 0
                and all_zero(self.staging_used_bytes) and all_zero(self.tracked_requests)
                and not self.grown)


def plan_requests(prompts: dict[int, list[int]], count: int, abandon_fraction: float,
                  seed: int, kinds: tuple[RequestKind, ...] = KINDS) -> list[LoadRequest]:
    rng = random.Random(seed)
    lengths = sorted(prompts)
    out = []
    for i in range(count):
        length = lengths[i % len(lengths)]
        abandon = rng.randint(0, 3) if rng.random() < abandon_fraction else None
        # Kinds in turn, shifted by one on each pass over the prompt lengths, so that every kind
        # meets every length (i % len(kinds) alone would pair them by their common divisor).
        kind = kinds[(i + i // len(lengths)) % len(kinds)]
        out.append(LoadRequest(i, tuple(prompts[length]), NEW_TOKENS[i % len(NEW_TOKENS)],
                               abandon, kind))
    return out


def _abandon(url: str, req: LoadRequest, timeout_s: float, rid: str) -> None:
    """Stream the request and hang up after `abandon_after` chunks, as a client that gives up."""
    body = {**req.kind.fields, "input_ids": list(req.prompt), "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": 0.0,
                                **req.kind.sampling}}
    with requests.post(url.rstrip("/") + "/generate", json=body, stream=True,
                       timeout=timeout_s) as r:
        seen = 0
        for line in r.iter_lines():
            if seen >= req.abandon_after:
                break
            seen += line.startswith(b"data:")


def run_round(cluster: Cluster, reqs: list[LoadRequest],
              references: dict[tuple[tuple, str], list[int]],
              baseline_slots: int, timeout_s: float, round_no: int = 0) -> LoadReport:
    report = LoadReport(len(reqs), sum(r.abandon_after is not None for r in reqs))
    start = threading.Barrier(len(reqs))
    lock = threading.Lock()

    def one(req: LoadRequest) -> None:
        start.wait()
        rid = request_id(round_no, req.index, req.kind)
        try:
            if req.abandon_after is not None:
                _abandon(cluster.url, req, timeout_s, rid)
                return
            got = generate_stream(cluster.url, input_ids=list(req.prompt),
                                  max_new_tokens=req.max_new_tokens, timeout_s=timeout_s,
                                  sampling=req.kind.sampling, fields=req.kind.fields, rid=rid)
        except (GenerateError, requests.RequestException) as exc:
            with lock:
                report.errors.append(f"request {req.index} ({len(req.prompt)} tokens): {exc}")
            return
        with lock:
            report.completed += 1
            if not req.kind.exact:
                return
            want = references[req.prompt, reference_key(req.kind)][: req.max_new_tokens]
            if got.output_ids != want:
                # Lengths may differ (an EOS on one side): compare the common prefix.
                pairs = zip(got.output_ids, want, strict=False)
                diverge = next((i for i, (a, b) in enumerate(pairs) if a != b),
                               min(len(got.output_ids), len(want)))
                report.mismatches.append({"request": req.index, "kind": req.kind.name,
                                          "prompt_tokens": len(req.prompt),
                                          "first_difference": diverge,
                                          "got": got.output_ids, "want": want})

    t0 = time.monotonic()
    with ThreadPoolExecutor(len(reqs)) as pool:
        list(pool.map(one, reqs))
    report.seconds = round(time.monotonic() - t0, 3)
    # Abandoned requests are aborted asynchronously: give the servers a moment to let go.
    deadline = time.monotonic() + SETTLE_S
    while True:
        used = cluster.decode_used_tokens() - baseline_slots
        urls = [*cluster.prefill_urls, cluster.decode_url]
        staging = {url: metric_sum(url, "lynx_staging_used_bytes") for url in urls}
        tracked = {url: metric_sum(url, "lynx_tracked_requests") for url in urls}
        if (used <= 0 and all_zero(staging) and all_zero(tracked)) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    report.leaked_decode_slots = max(used, 0)
    report.staging_used_bytes = staging
    report.tracked_requests = tracked
    report.speculation = tally(cluster.log_path("decode").read_text(errors="replace"), round_no)
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64,
                        help="concurrent requests per round (default 64)")
    parser.add_argument("--prefills", type=int, default=2,
                        help="prefill servers behind the router (default 2; one decode)")
    parser.add_argument("--abandon", type=float, default=0.25,
                        help="fraction of requests whose client hangs up after 0-3 streamed "
                             "chunks (default 0.25)")
    parser.add_argument("--duration-s", type=float, default=0.0,
                        help="soak: repeat rounds until this many seconds have passed "
                             "(default 0: one round)")
    parser.add_argument("--transfer-backend", choices=TRANSFER_BACKENDS, default="lynx")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout-s", type=float, default=1800.0,
                        help="each client's timeout, also SGLang's bootstrap and waiting "
                             "timeouts on the PD servers (default 1800: 256 requests queue for "
                             "about 10 min on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path("out/load.json"),
                        help="JSON report (default out/load.json)")
    add_kv_dtype_argument(parser)
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="pass SGLang's --disable-overlap-schedule to every server, the "
                             "reference single server included (default: SGLang's overlap "
                             "scheduler, what a deployment runs): to tell whether a mismatch or "
                             "leak depends on the scheduler, or to compare with rounds run that "
                             "way (before 2026-12-06)")
    parser.add_argument("--kinds", type=kinds_by_name, default=KINDS, metavar="KIND,...",
                        help="request kinds of the mix, in turn (default: all of "
                             f"{','.join(KIND_NAMES)}; see lynx_tools.load.mix)")
    parser.add_argument("--hold-residual-s", type=float, default=0.0,
                        help="the prefill holds each Residual this long after its Anchor (its "
                             "fault-injection knob), so that every request can speculate even on "
                             "loopback: to measure which kinds speculate (default 0)")
    parser.add_argument("server_args", nargs="*", metavar="-- SERVER_ARG",
                        help="extra flags for every server (e.g. -- --lynx-target int8)")


def run_load(model: str, *, requests_per_round: int, prefills: int, abandon: float,
             duration_s: float, transfer_backend: str, seed: int, timeout_s: float,
             server_args: tuple[str, ...], run_dir: Path,
             overlap_schedule: bool = False, kinds: tuple[RequestKind, ...] = KINDS,
             hold_residual_s: float = 0.0) -> list[LoadReport]:
    """The rounds of one run. `overlap_schedule`: SGLang's overlap scheduler on every server
    (the CLI's default); off by default here for the callers that keep the scheduling of
    earlier runs (tests/sglang/test_load.py). `kinds`: the request mix; `hold_residual_s`: the
    prefill's Residual hold (`--hold-residual-s`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = {n: passkey_prompt(tokenizer, n) for n in PROMPT_LENGTHS}
    common = ("--disable-radix-cache", "--enable-metrics", *server_args)
    single = ClusterSpec(model, ClusterMode.SINGLE, run_dir=run_dir / "single",
                         server_args=common, overlap_schedule=overlap_schedule)
    # One reference per prompt and per sampling of the deterministic kinds (greedy and logprobs
    # share theirs; a grammar has its own).
    samplings = {reference_key(k): k.sampling for k in kinds if k.exact}
    with Cluster(single) as cluster:
        logger.info("reference outputs of %d prompts x %d samplings from a single server",
                    len(prompts), len(samplings))
        references = {(tuple(ids), key): generate(cluster.url, input_ids=ids,
                                                  max_new_tokens=max(NEW_TOKENS),
                                                  sampling=sampling,
                                                  timeout_s=timeout_s).output_ids
                      for ids in prompts.values() for key, sampling in samplings.items()}
    # A round queues far more work than 2 CPU cores do in SGLang's default 300 s: its bootstrap
    # and waiting timeouts (the same for every backend) would fail requests for capacity, which
    # is not what a round checks. They get the client's timeout instead.
    pd = ClusterSpec(model, ClusterMode.PD, transfer_backend=transfer_backend,
                     run_dir=run_dir / "pd", server_args=common, prefills=prefills,
                     extra_env={**sglang_pd_timeouts_env(timeout_s),
                                **({FAULT_RESIDUAL_DELAY_ENV: str(hold_residual_s)}
                                   if hold_residual_s else {})},
                     overlap_schedule=overlap_schedule)
    reports = []
    with Cluster(pd) as cluster:
        baseline = cluster.decode_used_tokens()
        t_end = time.monotonic() + duration_s
        round_no = 0
        while True:
            reqs = plan_requests(prompts, requests_per_round, abandon, seed + round_no, kinds)
            report = run_round(cluster, reqs, references, baseline, timeout_s, round_no)
            report.resources = {name: cluster.resources(name) for name in cluster.names}
            # The first round's values are the baseline: servers open their pools lazily.
            first = reports[0].resources if reports else report.resources
            report.grown = [name for name, now in report.resources.items()
                            if now.grown_past(first[name])]
            reports.append(report)
            logger.info("round %d: %d requests (%d abandoned) in %.1f s: %d completed, "
                        "%d mismatches, %d errors, %d leaked decode slots, staging %s, "
                        "tracked %s, threads/fds/RSS %s%s; speculation %s",
                        round_no + 1, report.requests, report.abandoned, report.seconds,
                        report.completed, len(report.mismatches), len(report.errors),
                        report.leaked_decode_slots, report.staging_used_bytes,
                        report.tracked_requests,
                        {n: (r.threads, r.fds, r.rss_mib) for n, r in report.resources.items()},
                        f", GROWN: {report.grown}" if report.grown else "",
                        speculation_summary(report.speculation))
            round_no += 1
            if time.monotonic() >= t_end:
                return reports


def run(args: argparse.Namespace) -> int:
    model = str(embedded_model_dir())
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    reports = run_load(model, requests_per_round=args.requests, prefills=args.prefills,
                       abandon=args.abandon, duration_s=args.duration_s,
                       transfer_backend=args.transfer_backend, seed=args.seed,
                       timeout_s=args.request_timeout_s,
                       server_args=(*kv_dtype_server_args(args.kv_dtype), *args.server_args),
                       run_dir=out.parent / (out.stem + "_runs"),
                       overlap_schedule=not args.disable_overlap_schedule,
                       kinds=args.kinds, hold_residual_s=args.hold_residual_s)
    clean = all(r.clean for r in reports)
    out.write_text(json.dumps({"transfer_backend": args.transfer_backend,
                               "prefills": args.prefills, "clean": clean,
                               "overlap_schedule": not args.disable_overlap_schedule,
                               "kinds": [dataclasses.asdict(k) for k in args.kinds],
                               "hold_residual_s": args.hold_residual_s,
                               "rounds": [dataclasses.asdict(r) for r in reports]}, indent=1))
    total = sum(r.requests for r in reports)
    print(f"{len(reports)} round(s), {total} requests, {sum(r.abandoned for r in reports)} "
          f"abandoned, {sum(r.completed for r in reports)} completed and checked: "
          f"{sum(len(r.mismatches) for r in reports)} mismatches, "
          f"{sum(len(r.errors) for r in reports)} errors, "
          f"{max(r.leaked_decode_slots for r in reports)} leaked decode slots at most, "
          f"threads/fds grown past round 1 in {sum(bool(r.grown) for r in reports)} round(s); "
          f"{'clean' if clean else 'NOT clean'} (report: {out})")
    print("speculation (requests committed at Anchor time, all rounds): "
          + speculation_summary(merged_tallies(r.speculation for r in reports)))
    return 0 if clean else 1
