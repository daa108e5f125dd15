"""The run of `lynx-sglang bench-ttft --regime R1,R2,…` (called by `tools.ttft.bench.run`): every
variant's cluster up once on a shaped link, then for each R: the link at CALIBRATION_LINK, one
request to the baseline's cluster to measure the forward, every cluster's link re-shaped to the
rate that R asks for (`regime.link_rate_for`), and the prompts sent to the variants in turn
(`clusters.send_interleaved`). The link is a tc qdisc on the namespaces' veth pair, replaced in
place (`ShapedLink.set_rate`), so the clusters need no restart between R values.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from lynx_kernels import KVShape

from ..cluster.local import Cluster
from ..measure import model_kv_shape, wait_for
from ..progress import Progress
from ..trace_report import records_by_request
from ..variants import Variant, scheduler_note
from .clients import stream_round
from .clusters import Measured, read_traces, send_interleaved, start_clusters, variant_result
from .regime import (
    CALIBRATION_LINK,
    CALIBRATION_REQUESTS,
    Calibration,
    Regime,
    format_regime,
    format_report,
    link_rate_for,
    regime_json,
    slow_link_variant,
)
from .report import plot
from .results import BenchConfig, BenchError

JSON_NAME = "bench_ttft_regimes.json"


def calibrate(m: Measured, cluster: Cluster, prompt: list[int], cfg: BenchConfig) -> Calibration:
    """CALIBRATION_REQUESTS full-length requests to `cluster`, one at a time (its prefix cache
    flushed before each): send -> the prefill's forward done, from their `timeline` records."""
    trace_dir = m.run_dir / "trace"
    rids, samples = [], []
    for i in range(CALIBRATION_REQUESTS):
        got, ids = stream_round(cluster.url, cluster.prefill_url, f"{m.variant.name}-calibration",
                                [prompt], i, replace(cfg, max_new_tokens=1))
        timeline = _timeline_record(trace_dir, ids[0])
        if timeline is None:
            raise BenchError(f"{m.variant.name}: no timeline trace record for the calibration "
                             f"request {ids[0]} in {trace_dir}")
        rids.append(ids[0])
        samples.append(round(timeline["marks"]["prefill_done"] - got[0].t_send, 6))
    return Calibration(m.variant.name, tuple(rids), tuple(samples))


def settle(up: dict[str, tuple[Measured, Cluster]], prompt: list[int], cfg: BenchConfig) -> None:
    """One full-length request to each Lynx variant on the re-shaped link, not measured: a Lynx
    prefill chooses layer streaming by the link it measured (`--lynx-layer-stream-min-share`),
    and without it the first request of an R would go by the previous R's link."""
    for name, (m, cluster) in up.items():
        if m.variant.transfer_backend == "lynx":
            stream_round(cluster.url, cluster.prefill_url, f"{name}-settle", [prompt], 0,
                         replace(cfg, max_new_tokens=1))


def _timeline_record(trace_dir: Path, rid: str) -> dict | None:
    """`rid`'s timeline record, given the prefill a moment to write it."""
    wait_for(lambda: "timeline" in records_by_request(trace_dir, rid))
    return records_by_request(trace_dir, rid).get("timeline")


def shape_links(up: dict[str, tuple[Measured, Cluster]], rate: str) -> None:
    """Every cluster's shaped link re-shaped to `rate` in place (bench-ttft --regime, bench-load)."""
    for _, cluster in up.values():
        if cluster.link is None:
            raise BenchError("--regime needs shaped links (root)")
        cluster.link.set_rate(rate, cluster.spec.link_qdisc)


def measure_regime(r: float, up: dict[str, tuple[Measured, Cluster]], cfg: BenchConfig, *,
                   prompts: list[list[int]], warmup_ids: list[int], kv_bytes: int,
                   kv_shape: KVShape, progress: Progress) -> Regime:
    """One R: the forward measured at CALIBRATION_LINK, every link re-shaped to R's rate, one
    unmeasured request to each Lynx variant (`settle`), the prompts sent to the variants in
    turn. Also `lynx-sglang demo`'s (`tools.demo.run`) measurement of each R."""
    shape_links(up, CALIBRATION_LINK)
    base, base_cluster = up[cfg.baseline]
    calibration = calibrate(base, base_cluster, warmup_ids, cfg)
    rate = link_rate_for(r, kv_bytes, calibration.forward_s)
    progress.phase(f"R {r:g}: forward {calibration.forward_s:.2f} s (of "
                   f"{list(calibration.samples_s)}) -> link {rate.describe()}")
    shape_links(up, rate.tc)
    cfg_r = replace(cfg, link=rate.tc)
    settle(up, warmup_ids, cfg_r)
    # The same clusters, with what they measure started afresh: each R reports its own requests.
    fresh = {name: (Measured(m.variant, m.run_dir, m.warmup_attempts), c)
             for name, (m, c) in up.items()}
    send_interleaved(fresh, prompts, cfg_r, progress)
    for m, _ in fresh.values():
        read_traces(m)
    return Regime(rate, calibration, kv_bytes, cfg_r,
                  [variant_result(m, cfg_r, kv_shape) for m, _ in fresh.values()])


def run_regimes(rs: tuple[float, ...], variants: list[Variant], cfg: BenchConfig, *,
                prompts: list[list[int]], warmup_ids: list[int], model_dir: Path,
                kv_shape: KVShape, out: Path) -> int:
    """Every R of `rs` in turn on the same clusters (see the module docstring); 0, or 130 when
    interrupted. Raises BenchError, as bench-ttft does."""
    # R is defined on BF16 KV whatever --kv-dtype the servers' pools have.
    kv_bytes = model_kv_shape(model_dir, "bfloat16").bytes_for(cfg.prompt_tokens)
    print(f"[bench-ttft] --regime {','.join(f'{r:g}' for r in rs)}: model {model_dir}, "
          f"{cfg.prompt_tokens}-token prompts, BF16 KV {kv_bytes / 2**20:.1f} MiB; variants "
          f"{list(cfg.variants)} (interleaved), forward measured on {cfg.baseline}; "
          f"{scheduler_note(variants)}", flush=True)
    variants = [slow_link_variant(v, cfg.request_timeout_s) for v in variants]
    t0, load_start = time.monotonic(), os.getloadavg()
    progress = Progress("bench-ttft", len(variants))
    done: list[Regime] = []

    def write(complete: bool) -> None:
        """The JSON so far: written after every R, so a run cut short keeps what it has."""
        extra = {"complete": complete, "cpus": os.cpu_count(), "loadavg_start": load_start,
                 "loadavg_end": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1)}
        doc = {"regimes_requested": list(rs), "calibration_link": CALIBRATION_LINK,
               "kv_bf16_bytes": kv_bytes, **extra,
               "regimes": [regime_json(g, _link_desc(g.cfg), extra) for g in done]}
        (out / JSON_NAME).write_text(json.dumps(doc, indent=1))

    try:
        with contextlib.ExitStack() as stack:
            up = start_clusters(stack, variants, replace(cfg, link=CALIBRATION_LINK), warmup_ids,
                                out, progress)
            for r in rs:
                g = measure_regime(r, up, cfg, prompts=prompts, warmup_ids=warmup_ids,
                                   kv_bytes=kv_bytes, kv_shape=kv_shape, progress=progress)
                done.append(g)
                write(complete=False)
                print("\n" + format_regime(g) + "\n", flush=True)
                plot(g.results, g.cfg, out / f"bench_ttft_R{r:g}.png",
                     f"R {r:g}: {cfg.prompt_tokens}-token prompts, {_link_desc(g.cfg)}")
    except KeyboardInterrupt:
        print("[bench-ttft] interrupted; the running clusters were stopped", file=sys.stderr)
        return 130
    write(complete=True)
    print(format_report(done))
    print(f"\n[bench-ttft] wrote {out / JSON_NAME} and {out}/bench_ttft_R*.png "
          f"({time.monotonic() - t0:.0f} s)")
    return 0


def _link_desc(cfg: BenchConfig) -> str:
    return (f"{cfg.link} shaped veth between two network namespaces (prefill | decode), "
            f"{cfg.kv_dtype} KV")
