"""The stored benchmark results `plan` reads, as dataclasses: `bench-ttft` documents (plain and
`--regime` files under results/bench_ttft/) and `bench-load` runs (results/bench_load/). Only
what the model's calibration (`tools.plan.box`) and validation (`tools.plan.validate`) use: the
run's parameters (link, forward, prompt and output lengths, rate, the box's CPUs and their
pinning) and what it measured (latencies, each role's CPU seconds per pass).

A bench-load pass keeps no send times, but they are a function of its seed: sglang.bench_serving
(random-ids) seeds numpy with it, draws the prompt lengths, the output lengths and one token
offset per prompt, then one exponential interval after each request it sends (`send_times`, which
rebuilds them where they give back the stored prompt and output lengths; every stored pass's
duration is the sum of those intervals where its last request ended before the last one).
Reads JSON only: it imports none of the tools that wrote them.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BASELINES = ("mooncake-nospin", "mooncake")
# bench-load's --seed default (its files do not record the seed; the prompt lengths confirm it)
# and the vocabulary bench_serving draws each prompt's token offset below (SmolLM2-135M's).
BENCH_LOAD_SEED = 42
BENCH_LOAD_VOCAB = 49152


def parse_rate_bps(text: str) -> float:
    """A tc rate as bench-ttft's --link takes it ('1gbit', '35mbit', '20979kbit') in bit/s."""
    m = re.fullmatch(r"([0-9.]+)\s*([kmg]?)bit", text.strip().lower())
    if m is None:
        raise ValueError(f"not a link rate: {text!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


@dataclass(frozen=True)
class TtftRequest:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    prefill_done_s: float | None
    token_s: dict[int, float]  # the token marks (16, 64) from the send


@dataclass(frozen=True)
class TtftVariant:
    name: str
    server_args: tuple[str, ...]
    requests: list[TtftRequest]
    medians: dict[str, float]  # bench-ttft's own medians (lynx_client.ttft_s, .tpot_s, ...)


@dataclass(frozen=True)
class TtftRun:
    """One link of one bench-ttft file: requests one at a time."""

    label: str
    path: str
    link_bps: float
    prompt_tokens: int
    max_new_tokens: int
    marks: tuple[int, ...]
    forward_s: float | None  # the baseline's median send -> prefill done (regime: measured)
    variants: dict[str, TtftVariant]
    cpus: int
    role_cpus: dict[str, list[int]]  # bench-ttft --pin-roles; empty: unpinned


def _ttft_variants(bench: dict) -> dict[str, TtftVariant]:
    specs = {s["name"]: s for s in bench["config"]["variant_specs"]}
    out = {}
    for name, v in bench["variants"].items():
        reqs = [TtftRequest(r["prompt_tokens"], r["output_tokens"], r["ttft_s"],
                            r.get("prefill_done_s"),
                            {int(k): t for k, t in (r.get("token_s") or {}).items()})
                for r in v["requests"].get("lynx_client") or [] if r.get("ttft_s") is not None]
        out[name] = TtftVariant(name, tuple(specs.get(name, {}).get("server_args", ())), reqs,
                                v.get("medians") or {})
    return out


def _baseline_forward(variants: dict[str, TtftVariant]) -> float | None:
    for name in [n for n in BASELINES if n in variants] + list(variants):
        done = [r.prefill_done_s for r in variants[name].requests if r.prefill_done_s is not None]
        if done:
            return statistics.median(done)
    return None


def read_ttft(path: Path) -> list[TtftRun]:
    """Every link of a bench-ttft JSON (one for a plain run, one per R for --regime)."""
    doc = json.loads(Path(path).read_text())
    if "regimes" in doc:
        parts = [(f"R={r['r_target']:g}", r["bench"], r["rate"]["bps"], r.get("measured_forward_s"))
                 for r in doc["regimes"]]
    else:
        parts = [(doc["config"]["link"], doc, parse_rate_bps(doc["config"]["link"]), None)]
    runs = []
    for label, bench, bps, forward in parts:
        cfg, variants = bench["config"], _ttft_variants(bench)
        runs.append(TtftRun(f"{Path(path).name} {label}", str(path), float(bps),
                            cfg["prompt_tokens"], cfg["max_new_tokens"],
                            tuple(cfg.get("token_marks") or (16, 64)),
                            forward or _baseline_forward(variants), variants,
                            cfg.get("cpus") or doc.get("cpus"), cfg.get("role_cpus") or {}))
    return runs


@dataclass(frozen=True)
class LoadPass:
    variant: str
    rate: float
    input_lens: list[int]
    output_lens: list[int]
    ttfts_s: list[float]
    tpots_s: list[float | None]
    duration_s: float
    cpu_s: dict[str, float]  # each role's servers' CPU seconds in the pass (empty: not measured)
    send_s: list[float] | None  # each request's send from the first (None: not rebuilt)


@dataclass(frozen=True)
class LoadFigures:
    """What bench-load reported for one pass (its own percentiles)."""

    variant: str
    rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_median_s: float | None
    slo_attainment: float


@dataclass(frozen=True)
class LoadRun:
    path: str
    link_bps: float
    forward_s: float  # the calibration forward at prompt_tokens (the faster sample)
    prompt_tokens: int
    range_ratio: float
    max_new_tokens: int
    workload: str
    cpus: int
    role_cpus: dict[str, list[int]]  # --pin-roles; empty: unpinned
    slo_ttft_s: float
    passes: list[LoadPass]
    figures: list[LoadFigures]

    @property
    def pinned(self) -> bool:
        return bool(self.role_cpus)


def send_times(n: int, prompt_tokens: int, range_ratio: float, max_new_tokens: int, rate: float,
               seed: int = BENCH_LOAD_SEED) -> tuple[list[int], list[int], list[float]]:
    """(prompt lengths, output lengths, send times) of n random-ids requests at Poisson `rate`
    as sglang.bench_serving draws them with `seed` (sample_random_requests, then get_request)."""
    state = np.random.RandomState(seed)
    lens = state.randint(max(int(prompt_tokens * range_ratio), 1), prompt_tokens + 1, size=n)
    outs = state.randint(max(int(max_new_tokens * range_ratio), 1), max_new_tokens + 1, size=n)
    state.randint(0, BENCH_LOAD_VOCAB, size=n)
    sends = [0.0]
    for _ in range(n - 1):
        sends.append(sends[-1] + float(state.exponential(1.0 / rate)))
    return lens.tolist(), outs.tolist(), sends


def _rebuilt_sends(doc: dict, p: dict) -> list[float] | None:
    if (doc.get("workload") or {}).get("kind", "random") != "random":
        return None
    lens, outs, sends = send_times(len(p["input_lens"]), doc["prompt_tokens"], doc["range_ratio"],
                                   doc["max_new_tokens"], p["rate"])
    return sends if (lens, outs) == (p["input_lens"], p["output_lens"]) else None


def read_load(path: Path) -> LoadRun:
    doc = json.loads(Path(path).read_text())
    rep = doc["report"]
    passes = [LoadPass(p["variant"], p["rate"], p["input_lens"], p["output_lens"], p["ttfts_s"],
                       p["tpots_s"], p["duration_s"], p.get("cpu_s") or {},
                       _rebuilt_sends(doc, p)) for p in rep["passes"]]
    figures = [LoadFigures(f["variant"], f["rate"], f["ttft_p50_s"], f["ttft_p99_s"],
                           f["tpot_median_s"], f["slo_attainment"]) for f in rep["figures"]]
    return LoadRun(str(path), float(doc["link"]["bps"]), doc["forward_s"]["fastest"],
                   doc["prompt_tokens"], doc["range_ratio"], doc["max_new_tokens"],
                   (doc.get("workload") or {}).get("kind", "random"), doc["cpus"],
                   doc.get("role_cpus") or {}, rep["slo_ttft_s"], passes, figures)
