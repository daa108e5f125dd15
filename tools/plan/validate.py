"""`plan`'s check against this box: the model run with each stored run's own parameters (link,
measured forward, prompt and output lengths, rate, the speculation cap of the code it measured)
and this box's stage costs (`tools.plan.box`), beside what the run measured.

bench-ttft (one request at a time): the median TTFT, 16th and 64th token from the send, per
variant; the model's median over `TTFT_REPLICAS` requests (the speculation's acceptance is drawn
per request). bench-load (Poisson, 8 requests a pass): P50 and P99 TTFT and the median time per
output token of each pass; the model's median over `LOAD_REPLICAS` passes of the same prompts in
the same order with fresh Poisson arrivals (the stored files keep no arrival times).

Figures that fed a stage cost are marked `calibration` and left out of the summary: mooncake-
nospin's TTFT in the fast-link runs (the fixed cost) and its token times in bench-ttft (the decode
step). Caller: `lynx-sglang plan --validate` (tools.plan.cli), tests/test_plan.py.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .box import FIXED_COST_RUNS, BoxCosts, read_box_costs
from .model import (
    INT4_ANCHOR,
    LYNX,
    LYNX_INT8,
    LYNX_INT8_NOSPEC,
    MOONCAKE,
    PRESETS,
    Arrival,
    Deployment,
    ForwardTime,
    Variant,
    percentile,
    simulate,
)
from .stored import LoadRun, read_load, read_ttft

TOLERANCE = 0.15
# What the model claims against the stored runs (tests/test_plan.py holds it to these): every
# single-request figure within TOLERANCE; under load only the median |error| below, the TTFTs
# biased low (see KNOWN_MISSES).
LOAD_TTFT_MEDIAN_ERROR = 0.35
KNOWN_MISSES = (
    "bench-load TTFT is predicted low (30 of 32 P50s): the passes' forwards ran ~1.3-1.5x the "
    "calibration forward scaled to their lengths (on 2 shared cores the decode's steps, other "
    "variants' idle clusters and Lynx's encode and apply take CPU from the forward; the model has "
    "no CPU contention), and one pass is 8 requests, so its P99 is its slowest request",
    "bench-load at 0.2-0.3 req/s (R = 1, 2026-12-06): the box served only 0.25-0.35 req/s, the "
    "model's prefill is busy 0.5-0.7 of the time: it predicts no overload where the box had one "
    "(errors 60-75 %)",
    "bench-load --pin-roles: the decode step is taken as 43 x the forward per prompt token, as on "
    "the shared box; pinned, the forward has one core and the decode its own, so the step is "
    "predicted 1.6x too slow there",
    "Lynx's time per output token under load at R = 4 is predicted 26-46 % low: its verified "
    "tokens wait for Residuals that came later than the model's link has them (not examined; "
    "one guess is that the shaped link shares its rate among the flows in flight, where the "
    "model serves Anchors first and Residuals one at a time)",
)
TTFT_REPLICAS = 200
LOAD_REPLICAS = 300
SHAPE = PRESETS["SmolLM2-135M"]

# The bench-ttft files that measured the current data path (overlap scheduler and layer
# streaming, 2026-12-06 on), with the speculation cap of the commit each measured (32 before
# d2060d4, 128 from it).
TTFT_RUNS: tuple[tuple[str, int], ...] = (
    ("bench_ttft/bench_ttft_10mbit_1500tok_overlap_layer_streamed_interleaved_2026-12-06.json", 32),
    ("bench_ttft/bench_ttft_1gbit_stream_policy_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_5gbit_stream_policy_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_regime1_stream_policy_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_regime1_0.3_anchor_width_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_regime16_4_anchor_width_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_regime4_1_four_variants_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_regime4_1_spec_cap_2026-12-07.json", 32),
    ("bench_ttft/bench_ttft_regime16_four_variants_2026-12-07.json", 128),
    ("bench_ttft/bench_ttft_regime16_residual_eta_fix_2026-12-07.json", 128),
)
# Every bench-load file; the RAG run is skipped (the prefill's prefix cache is not modelled).
LOAD_RUNS = tuple(f"bench_load/{p.name}" for p in sorted(
    (Path(__file__).resolve().parents[2] / "results" / "bench_load").glob("*.json")))

# Measured variant name -> the modelled variant and, where its name fixes it, its cap.
ALIASES: dict[str, tuple[Variant, int | None]] = {
    "mooncake-nospin": (MOONCAKE, None),
    "lynx": (LYNX, None),
    "lynx@no-overlap": (LYNX, None),
    "lynx-int8": (LYNX_INT8, None),
    "lynx-spec128": (LYNX, 128),
    "lynx-int8-spec128": (LYNX_INT8, 128),
    "lynx-int8-nospec": (LYNX_INT8_NOSPEC, None),
    "int4-anchor": (INT4_ANCHOR, None),
}


@dataclass(frozen=True)
class Residual:
    source: str  # bench-ttft / bench-load
    run: str
    variant: str
    metric: str
    predicted: float
    measured: float
    calibration: bool = False

    @property
    def rel_error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Skipped:
    run: str
    variant: str
    why: str


@dataclass
class Validation:
    residuals: list[Residual] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def summary(self) -> list[dict]:
        """Per source, metric and variant: how many, the median |relative error|, the share
        within TOLERANCE (calibration figures left out)."""
        groups: dict[tuple[str, str, str], list[float]] = {}
        for r in self.residuals:
            if not r.calibration:
                groups.setdefault((r.source, r.metric, r.variant), []).append(abs(r.rel_error))
        return [{"source": s, "metric": m, "variant": v, "n": len(errs),
                 "median_abs_rel_error": round(statistics.median(errs), 3),
                 "within_tolerance": round(sum(e <= TOLERANCE for e in errs) / len(errs), 3)}
                for (s, m, v), errs in sorted(groups.items())]

    def to_json(self, box: BoxCosts) -> dict:
        return {
            "kind": "plan's model against this box's stored runs (predicted vs measured)",
            "tolerance": TOLERANCE,
            "claims": {"bench-ttft": f"every figure within {TOLERANCE:.0%}",
                       "bench-load": f"TTFT median |error| <= {LOAD_TTFT_MEDIAN_ERROR:.0%}, "
                                     "biased low: the 15 % goal is NOT met under load"},
            "known_misses": list(KNOWN_MISSES),
            "box_costs": asdict(box),
            "summary": self.summary(),
            "residuals": [{**asdict(r), "rel_error": round(r.rel_error, 4)}
                          for r in self.residuals],
            "skipped": [asdict(s) for s in self.skipped],
        }


def _deployment(box: BoxCosts, forward_s: float, ref_tokens: int, prompts, outputs, rate,
                link_bps, cap: int) -> Deployment:
    return Deployment(SHAPE, tuple(prompts), tuple(outputs), rate, link_bps, 1,
                      ForwardTime.measured(forward_s, ref_tokens),
                      box.decode_step(forward_s, ref_tokens), box.stage_costs(cap))


def validate_ttft(box: BoxCosts, results: Path, out: Validation) -> None:
    for rel, cap in TTFT_RUNS:
        for run in read_ttft(results / rel):
            for name, measured in run.variants.items():
                if name not in ALIASES:
                    out.skipped.append(Skipped(run.label, name, "a 3-bit or per-request Anchor "
                                               "width: the model has the 4-bit Anchor's bytes"))
                    continue
                if not measured.requests or run.forward_s is None:
                    continue
                variant, own_cap = ALIASES[name]
                outputs = measured.requests[0].output_tokens
                dep = _deployment(box, run.forward_s, run.prompt_tokens, (run.prompt_tokens,),
                                  (outputs,), 0.0, run.link_bps, own_cap or cap)
                rng = random.Random(0)
                arrivals = [Arrival(i * 1e6, 0, run.prompt_tokens, outputs)
                            for i in range(TTFT_REPLICAS)]
                sim = simulate(dep, variant, arrivals, rng)
                baseline = name == "mooncake-nospin"
                fixed_run = baseline and rel in FIXED_COST_RUNS
                add = out.residuals.append
                add(Residual("bench-ttft", run.label, name, "ttft_median_s",
                             statistics.median(r.ttft_s for r in sim),
                             statistics.median(r.ttft_s for r in measured.requests), fixed_run))
                for k in run.marks:
                    got = [r.token_s[k] for r in measured.requests if k in r.token_s]
                    if got:
                        add(Residual("bench-ttft", run.label, name, f"t{k}_median_s",
                                     statistics.median(r.token_s(k) for r in sim),
                                     statistics.median(got), baseline))


def _load_pass_prediction(dep: Deployment, variant: Variant, lens: list[int], outs: list[int],
                          rate: float) -> tuple[float, float, float]:
    """Median over LOAD_REPLICAS passes of (P50 TTFT, P99 TTFT, median TPOT)."""
    rng = random.Random(0)
    p50s, p99s, tpots = [], [], []
    for _ in range(LOAD_REPLICAS):
        t, arrivals = 0.0, []
        for tokens, n_out in zip(lens, outs, strict=True):
            t += rng.expovariate(rate)
            arrivals.append(Arrival(t, 0, tokens, n_out))
        sim = simulate(dep, variant, arrivals, rng)
        ttfts = [r.ttft_s for r in sim]
        p50s.append(percentile(ttfts, 50))
        p99s.append(percentile(ttfts, 99))
        tpots.append(statistics.median(t for r in sim if (t := r.tpot_s) is not None))
    return statistics.median(p50s), statistics.median(p99s), statistics.median(tpots)


def validate_load(box: BoxCosts, results: Path, out: Validation) -> None:
    for rel in LOAD_RUNS:
        run: LoadRun = read_load(results / rel)
        label = Path(rel).name + (" (pinned)" if run.pinned else "")
        for p in run.passes:
            tag = f"{p.variant} @ {p.rate:g} req/s"
            if run.workload != "random":
                out.skipped.append(Skipped(label, tag, "RAG: the prefill's prefix cache (a cached "
                                           "question's forward is the question alone) is not "
                                           "modelled"))
                continue
            if p.variant not in ALIASES:
                out.skipped.append(Skipped(label, tag, "variant not modelled"))
                continue
            variant, own_cap = ALIASES[p.variant]
            # Before d2060d4 (every bench-load file here) the cap was 32.
            dep = _deployment(box, run.forward_s, run.prompt_tokens, p.input_lens, p.output_lens,
                              p.rate, run.link_bps, own_cap or 32)
            p50, p99, tpot = _load_pass_prediction(dep, variant, p.input_lens, p.output_lens,
                                                   p.rate)
            fig = next(f for f in run.figures if f.variant == p.variant and f.rate == p.rate)
            name = f"{label} {p.rate:g} req/s"
            out.residuals.append(Residual("bench-load", name, p.variant, "ttft_p50_s", p50,
                                          fig.ttft_p50_s))
            out.residuals.append(Residual("bench-load", name, p.variant, "ttft_p99_s", p99,
                                          fig.ttft_p99_s))
            if fig.tpot_median_s:
                out.residuals.append(Residual("bench-load", name, p.variant, "tpot_median_s",
                                              tpot, fig.tpot_median_s))


def validate(results: Path) -> tuple[Validation, BoxCosts]:
    results = Path(results)
    box = read_box_costs(results)
    out = Validation()
    validate_ttft(box, results, out)
    validate_load(box, results, out)
    return out, box
