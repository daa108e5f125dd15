"""The stored benchmark results `plan` reads, as dataclasses: `bench-ttft` documents (plain and
`--regime` files under results/bench_ttft/) and `bench-load` runs (results/bench_load/). Only
what the model's calibration (`tools.plan.box`) and validation (`tools.plan.validate`) use: the
run's parameters (link, forward, prompt and output lengths, rate) and what it measured.
Reads JSON only: it imports none of the tools that wrote them.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

BASELINES = ("mooncake-nospin", "mooncake")


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
                            forward or _baseline_forward(variants), variants))
    return runs


@dataclass(frozen=True)
class LoadPass:
    variant: str
    rate: float
    input_lens: list[int]
    output_lens: list[int]
    ttfts_s: list[float]
    tpots_s: list[float | None]


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
    max_new_tokens: int
    workload: str
    pinned: bool
    slo_ttft_s: float
    passes: list[LoadPass]
    figures: list[LoadFigures]


def read_load(path: Path) -> LoadRun:
    doc = json.loads(Path(path).read_text())
    rep = doc["report"]
    passes = [LoadPass(p["variant"], p["rate"], p["input_lens"], p["output_lens"], p["ttfts_s"],
                       p["tpots_s"]) for p in rep["passes"]]
    figures = [LoadFigures(f["variant"], f["rate"], f["ttft_p50_s"], f["ttft_p99_s"],
                           f["tpot_median_s"], f["slo_attainment"]) for f in rep["figures"]]
    return LoadRun(str(path), float(doc["link"]["bps"]), doc["forward_s"]["fastest"],
                   doc["prompt_tokens"], doc["max_new_tokens"],
                   (doc.get("workload") or {}).get("kind", "random"),
                   bool(doc.get("role_cpus")), rep["slo_ttft_s"], passes, figures)
