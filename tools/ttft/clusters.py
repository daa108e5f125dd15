"""The PD clusters of `lynx-sglang bench-ttft` (tools/ttft/bench.py): one per variant
(`cluster_spec`), started and warmed up together (`start_clusters`), sent rounds of prompts in
turns (`send_interleaved`, `interleaved_order`), and what each gave (`Measured`, read back from the
servers' trace records by `read_traces`, turned into a `VariantResult` by `variant_result`).

Callers: `tools.ttft.bench` (one variant at a time, or `--interleave`) and `tools.ttft.regime_run`
(`--regime`: the same clusters kept up across link rates).
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from lynx_kernels import KVShape
from lynx_sglang.names import TIMELINE_ENV, TRACE_DIR_ENV
from lynx_sglang.trace import read_records

from ..client import GenerateError, StreamedGeneration
from ..cluster.local import Cluster
from ..cluster.spec import ClusterMode, ClusterSpec
from ..measure import kv_dtype_server_args, wait_for
from ..progress import Progress
from ..trace_report import breakdown, parse_rate, records_by_request
from ..variants import Variant
from .clients import stream_round_outcomes, warm_up
from .results import BenchConfig, BenchError, RequestTiming, VariantResult, client_timing


def interleaved_order(names: list[str], rounds: int) -> list[list[str]]:
    """Which variant sends each round first (`--interleave`): the order turns by one each round,
    so that none always goes first, or always right after another, on a box whose speed drifts."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def same_text(bench: list[RequestTiming], client: list[RequestTiming]) -> bool | None:
    """Whether both clients got the same text for each prompt; None when bench_serving did not
    run."""
    return [b.text for b in bench] == [c.text for c in client] if bench else None


def cluster_spec(variant: Variant, cfg: BenchConfig, run_dir: Path) -> ClusterSpec:
    return ClusterSpec(cfg.model, ClusterMode.PD, variant.transfer_backend, run_dir=run_dir,
                       server_args=variant.server_args + kv_dtype_server_args(cfg.kv_dtype),
                       link=cfg.link, startup_timeout_s=cfg.startup_timeout_s, tls=variant.tls,
                       overlap_schedule=variant.overlap_schedule, role_cpus=cfg.role_cpus,
                       extra_env={**dict(variant.env), TIMELINE_ENV: "1",
                                  TRACE_DIR_ENV: str(run_dir / "trace")})


@dataclass
class Measured:
    """What one variant's cluster gave, read while it was still up (`read_traces`)."""

    variant: Variant
    run_dir: Path
    warmup_attempts: int
    bench: list[RequestTiming] = field(default_factory=list)
    streamed: list[StreamedGeneration] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    per_request: list[dict] = field(default_factory=list)
    server_config: dict | None = None
    # The prompt number of each entry of `streamed`, and the requests that failed ({"prompt",
    # "rid", "error"}): an interleaved run goes on past a failed request (`send_interleaved`).
    prompts: list[int] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)


def read_traces(m: Measured) -> None:
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


def speculation_of(records: dict) -> dict[str, int] | None:
    """Speculated / accepted / rolled-back tokens of one request, from the decode's `spec` record
    (speculative Lynx, written at its verification); None where it has none."""
    spec = records.get("spec")
    if spec is None:
        return None
    f = spec["facts"]
    return {"speculated": f["speculated"], "accepted": f["accepted"],
            "rolled_back": f["speculated"] - f["accepted"]}


def variant_result(m: Measured, cfg: BenchConfig, kv_shape: KVShape) -> VariantResult:
    is_lynx = m.variant.transfer_backend == "lynx"
    rate = parse_rate(cfg.link)
    client = []
    for i, g, rid, records in zip(m.prompts, m.streamed, m.rids, m.per_request, strict=True):
        transfer = None
        if is_lynx:
            transfer = dict(records["decode"]["marks"])
            facts = records["decode"]["facts"]
            transfer.update(anchor_bytes=facts["anchor_bytes"],
                            residual_bytes=facts["residual_bytes"],
                            anchor_bits=facts.get("anchor_bits"))
        client.append(client_timing(i, g, cfg.token_marks,
                                    records["timeline"]["marks"]["prefill_done"], transfer,
                                    breakdown(records, rid, g.t_first_token, rate),
                                    speculation_of(records)))
    if is_lynx and client:
        stream_bytes = lynx_stream_bytes(m.variant.name, [r.stream_bytes for r in client])
    elif is_lynx:
        stream_bytes = {}  # every request failed
    else:
        stream_bytes = {"kv": kv_shape.bytes_for(cfg.prompt_tokens)}
    return VariantResult(m.variant, m.bench + client, stream_bytes, is_lynx,
                         same_text(m.bench, client), str(m.run_dir), m.warmup_attempts,
                         m.server_config, failed=tuple(m.failed))


def start_clusters(stack: contextlib.ExitStack, variants: list[Variant], cfg: BenchConfig,
                   warmup_ids: list[int], out: Path,
                   progress: Progress) -> dict[str, tuple[Measured, Cluster]]:
    """Every variant's cluster up and warmed up, closed with `stack`; variant name -> (what it
    measures, its cluster), in the order of `variants`."""
    up: dict[str, tuple[Measured, Cluster]] = {}
    for v in variants:
        run_dir = run_dir_of(out, v)
        progress.start_variant(v.name, "starting cluster (interleaved: all stay up): "
                                       f"prefill + decode + router (logs {run_dir})")
        cluster = stack.enter_context(
            Cluster(cluster_spec(v, cfg, run_dir), on_wait=progress.waiting))
        up[v.name] = (Measured(v, run_dir, warm_up(cluster.url, warmup_ids, cfg, progress)),
                      cluster)
        progress.finish_variant()
    return up


def send_interleaved(up: dict[str, tuple[Measured, Cluster]], prompts: list[list[int]],
                     cfg: BenchConfig, progress: Progress) -> None:
    """Each round of prompts to one cluster after another (`interleaved_order`); the streams
    and request ids go to each variant's `Measured`, and a request that fails (an HTTP error, an
    abort, its timeout) to its `failed`, the run going on."""
    n = cfg.concurrency
    starts = range(0, len(prompts), n)
    for start, names in zip(starts, interleaved_order(list(up), len(starts)), strict=True):
        round_ = prompts[start: start + n]
        for name in names:
            m, cluster = up[name]
            progress.note(f"{name}: request {start + len(round_)}/{len(prompts)} "
                          "(lynx_tools.client)")
            outcomes, ids = stream_round_outcomes(cluster.url, cluster.prefill_url, name, round_,
                                                  start, cfg)
            for j, (got, rid) in enumerate(zip(outcomes, ids, strict=True)):
                if isinstance(got, GenerateError):
                    # One failed request costs its own sample, not the run's other requests.
                    progress.note(f"{name}: request {start + j + 1} failed: {got}")
                    m.failed.append({"prompt": start + j, "rid": rid, "error": str(got)})
                else:
                    m.streamed.append(got)
                    m.rids.append(rid)
                    m.prompts.append(start + j)


def run_dir_of(out: Path, variant: Variant) -> Path:
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
