"""`plan`'s check against this box: the model run with each stored run's own parameters (link,
measured forward, prompt and output lengths, rate, send times, the box's CPUs and their pinning,
the speculation cap of the code it measured) and this box's stage costs and CPU demands
(`tools.plan.box`), beside what the run measured. This box's profile: the deployment's `cpu` is
the run's 2 shared cores (`tools.plan.shared_cpu`); a GPU prediction has none.

bench-ttft (one request at a time): the median TTFT, 16th and 64th token from the send, per
variant; the model's median over `TTFT_REPLICAS` requests (the speculation's acceptance is drawn
per request). bench-load (Poisson, 8 requests a pass): P50 and P99 TTFT and the median time per
output token of each pass; the model's pass has the same prompts sent at the same moments (the
send times rebuilt from the seed, `tools.plan.stored.send_times`), its median over
`LOAD_REPLICAS` draws of the speculation's acceptance.

Each residual has a split: `calibration` where the figure, or the run, fed a cost (mooncake-
nospin's TTFT in the fast-link runs: the fixed cost; its token times in bench-ttft: the decode
step; every pass of `box.CPU_CALIBRATION_RUN`, whose CPU seconds gave the CPU demands), else
`validation`; the summaries keep them apart. `ablations`: the bench-load validation again without
the CPU contention, and without the rebuilt send times (fresh Poisson passes, as before them).
Caller: `lynx-sglang plan --validate` (tools.plan.cli), tests/test_plan.py.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..percentiles import percentile
from .box import ALIASES, CPU_CALIBRATION_RUN, FIXED_COST_RUNS, BoxCosts, read_box_costs
from .model import (
    PRESETS,
    Arrival,
    Deployment,
    ForwardTime,
    SharedCpu,
    Variant,
)
from .predict import simulate
from .stored import LoadPass, LoadRun, read_load, read_ttft

TOLERANCE = 0.15
# What the model claims against the stored runs (tests/test_plan.py holds it to these): every
# single-request figure of the validation split within TOLERANCE; under load (the validation
# split of bench-load) the median |relative error| per metric below, and each of the two
# mechanisms the load model adds (the CPU shared by session, the rebuilt send times) closer than
# the model without it. The 15 % goal is met under load by mooncake's TTFT P50 (median 9 %) and
# by the time per output token (5 %), not by Lynx's TTFT: see KNOWN_MISSES.
LOAD_MEDIAN_ERROR = {"ttft_p50_s": 0.20, "ttft_p99_s": 0.20, "tpot_median_s": 0.08}
KNOWN_MISSES = (
    "Lynx's TTFT under load (bench-load validation P50 within 15 % in 5 of 14 passes, 12 "
    "predicted low; all 6 Lynx passes of the calibration run 35-57 % low): requests that meet "
    "nothing, in the model or in the measured timeline (the previous request's last token came "
    "before their send), took a median 1.21x (up to 4.1x, 46 of 88 over 1.15x) the one-request "
    "TTFT that bench-ttft's Lynx runs match within 15 %, where mooncake's took 1.03x (32 such "
    "requests). They gather in the R1 four-variant run (its Lynx requests 1.5-3.0x: a forward "
    "on one core's share, though its Lynx prefills used the same CPU per forward as mooncake's, "
    "so the other core went to something outside the servers' process trees), the pinned run's "
    "Lynx passes (1.5-4.1x; its Lynx prefill used 1.2x the CPU its calibration forward implies) "
    "and the first request of R4's 0.05 req/s passes (1.6-3.4x). Not modelled: the files keep "
    "no per-request stage times to say where the time went",
    "The overloaded R1 run at 0.2-0.3 req/s (2026-12-06, no CPU seconds recorded): TTFT P50 "
    "25-37 % low with the contention (41-49 % without): its forwards ran slower still than a "
    "forward, mooncake's polling sender and the decode sharing 2 cores by session give",
    "Lynx's time per output token at R1 under load (0.2-0.3 req/s; pinned, 0.1 req/s) 37-38 % "
    "low: its steps ran 1.4-1.6x mooncake's at the same load while it also took in and wrote "
    "other requests' Anchor and Residual layers between steps (the model charges the apply "
    "only, as a codec thread)",
    "mooncake's time per output token in the R1 run of 2026-12-06 at 0.05-0.1 req/s 27-51 % "
    "high: the decode step is 43x the run's forward per prompt token (bench-ttft's ratio); that "
    "run's calibration forward was slow (3.6 ms per token) where its steps were not (ratio ~30)",
    "A pass is 8 requests: its P99 is about its slowest request, so one request of the kinds "
    "above moves it by tens of percent (R4 four-variant Lynx at 0.05 req/s: P99 53 % low from "
    "its first request alone)",
)
TTFT_REPLICAS = 200
LOAD_REPLICAS = 100
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
# The bench-load runs validated, named (a new result file must not change the stored validation
# unseen); the RAG run is skipped (the prefill's prefix cache is not modelled). Not in the list:
# the 2026-12-08 link-order runs (`--lynx-link-order`'s rules are not modelled, the model's link
# is strict Anchor-first; and runs v1 and v2 were taken on a box loaded by other suites).
LOAD_RUNS = tuple(f"bench_load/{name}" for name in (
    "bench_load_R1_four_variants_2026-12-07.json",
    "bench_load_R1_pinned_rates0.05-0.1_2026-12-07.json",
    "bench_load_R1_rag_rate0.1_2026-12-07.json",
    "bench_load_R1_rates0.05-0.1_2026-12-06.json",
    "bench_load_R1_rates0.2-0.3_2026-12-06.json",
    "bench_load_R4_four_variants_2026-12-07.json",
    "bench_load_R4_rates0.05-0.1_2026-12-06.json",
))
# Before d2060d4 (every bench-load file here) the speculation cap was 32.
LOAD_SPEC_CAP = 32


@dataclass(frozen=True)
class Residual:
    source: str  # bench-ttft / bench-load
    run: str
    variant: str
    metric: str
    predicted: float
    measured: float
    split: str = "validation"  # or "calibration": the figure or its run fed a cost

    @property
    def rel_error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True)
class Skipped:
    run: str
    variant: str
    why: str


def _summary(residuals: list[Residual], by_variant: bool) -> list[dict]:
    """Per source and metric (and variant): how many, the median |relative error|, the share
    within TOLERANCE, how many predicted low."""
    groups: dict[tuple[str, ...], list[float]] = {}
    for r in residuals:
        key = (r.source, r.metric, r.variant) if by_variant else (r.source, r.metric)
        groups.setdefault(key, []).append(r.rel_error)
    out = []
    for key, errs in sorted(groups.items()):
        row = dict(zip(("source", "metric", "variant"), key, strict=False))
        out.append(row | {"n": len(errs),
                          "median_abs_rel_error": round(statistics.median(map(abs, errs)), 3),
                          "within_tolerance": round(sum(abs(e) <= TOLERANCE for e in errs)
                                                    / len(errs), 3),
                          "predicted_low": sum(e < 0 for e in errs)})
    return out


@dataclass
class Validation:
    residuals: list[Residual] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    # The bench-load residuals of each ablation (the model less one mechanism).
    ablations: dict[str, list[Residual]] = field(default_factory=dict)

    def of(self, split: str) -> list[Residual]:
        return [r for r in self.residuals if r.split == split]

    def summary(self) -> list[dict]:
        """The validation split per source, metric and variant."""
        return _summary(self.of("validation"), by_variant=True)

    def to_json(self, box: BoxCosts) -> dict:
        return {
            "kind": "plan's model against this box's stored runs (predicted vs measured)",
            "tolerance": TOLERANCE,
            "splits": {
                "calibration": "mooncake-nospin's TTFT in " + ", ".join(FIXED_COST_RUNS)
                               + " (fixed cost) and its token times in bench-ttft (decode step); "
                               f"every pass of {CPU_CALIBRATION_RUN} (its CPU seconds gave the "
                               "CPU demands; its latencies fed nothing)",
                "validation": "every other figure"},
            "claims": {"bench-ttft": f"every validation figure within {TOLERANCE:.0%}",
                       "bench-load": "validation split, median |error| <= "
                                     + ", ".join(f"{v:.0%} ({k})"
                                                 for k, v in LOAD_MEDIAN_ERROR.items())
                                     + "; the 15 % goal is NOT met by Lynx's TTFT under load"},
            "known_misses": list(KNOWN_MISSES),
            "box_costs": asdict(box),
            "summary_validation": _summary(self.of("validation"), by_variant=False),
            "summary_calibration": _summary(self.of("calibration"), by_variant=False),
            "summary": self.summary(),
            "ablations": {name: _summary([r for r in rs if r.split == "validation"], False)
                          for name, rs in self.ablations.items()},
            "residuals": [{**asdict(r), "rel_error": round(r.rel_error, 4)}
                          for r in self.residuals],
            "skipped": [asdict(s) for s in self.skipped],
        }


def _deployment(box: BoxCosts, cpu: SharedCpu | None, forward_s: float, ref_tokens: int,
                prompts, outputs, rate, link_bps, cap: int) -> Deployment:
    """`forward_s`: measured alone on the run's CPUs, so at full speed x their alone rate."""
    alone = forward_s * (cpu.forward_alone_rate() if cpu else 1.0)
    return Deployment(SHAPE, tuple(prompts), tuple(outputs), rate, link_bps, 1,
                      ForwardTime.measured(alone, ref_tokens), box.decode_step(alone, ref_tokens),
                      box.stage_costs(cap), cpu=cpu)


def validate_ttft(box: BoxCosts, results: Path, out: Validation) -> None:
    for rel, cap in TTFT_RUNS:
        for run in read_ttft(results / rel):
            cpu = box.shared_cpu(run.cpus, run.role_cpus)
            for name, measured in run.variants.items():
                if name not in ALIASES:
                    out.skipped.append(Skipped(run.label, name, "a 3-bit or per-request Anchor "
                                               "width: the model has the 4-bit Anchor's bytes"))
                    continue
                if not measured.requests or run.forward_s is None:
                    continue
                variant, own_cap = ALIASES[name]
                outputs = measured.requests[0].output_tokens
                dep = _deployment(box, cpu, run.forward_s, run.prompt_tokens,
                                  (run.prompt_tokens,), (outputs,), 0.0, run.link_bps,
                                  own_cap or cap)
                rng = random.Random(0)
                arrivals = [Arrival(i * 1e6, 0, run.prompt_tokens, outputs)
                            for i in range(TTFT_REPLICAS)]
                sim = simulate(dep, variant, arrivals, rng)
                baseline = name == "mooncake-nospin"
                fixed_run = baseline and rel in FIXED_COST_RUNS
                add = out.residuals.append
                add(Residual("bench-ttft", run.label, name, "ttft_median_s",
                             statistics.median(r.ttft_s for r in sim),
                             statistics.median(r.ttft_s for r in measured.requests),
                             "calibration" if fixed_run else "validation"))
                for k in run.marks:
                    got = [r.token_s[k] for r in measured.requests if k in r.token_s]
                    if got:
                        add(Residual("bench-ttft", run.label, name, f"t{k}_median_s",
                                     statistics.median(r.token_s(k) for r in sim),
                                     statistics.median(got),
                                     "calibration" if baseline else "validation"))


def _pass_prediction(dep: Deployment, variant: Variant, p: LoadPass, sends: list[float] | None,
                     seed: int = 0) -> tuple[float, float, float]:
    """Median over LOAD_REPLICAS passes of (P50 TTFT, P99 TTFT, median TPOT): the stored pass's
    send times (acceptance drawn afresh each time), or with `sends` None fresh Poisson ones."""
    rng = random.Random(seed)
    p50s, p99s, tpots = [], [], []
    for _ in range(LOAD_REPLICAS):
        if sends is None:
            t, times = 0.0, []
            for _ in p.input_lens:
                t += rng.expovariate(p.rate)
                times.append(t)
        else:
            times = sends
        arrivals = [Arrival(t, 0, n, o)
                    for t, n, o in zip(times, p.input_lens, p.output_lens, strict=True)]
        sim = simulate(dep, variant, arrivals, rng)
        ttfts = [r.ttft_s for r in sim]
        p50s.append(percentile(ttfts, 50))
        p99s.append(percentile(ttfts, 99))
        tpots.append(statistics.median(t for r in sim if (t := r.tpot_s) is not None))
    return statistics.median(p50s), statistics.median(p99s), statistics.median(tpots)


def _load_residuals(run: LoadRun, name: str, split: str, p: LoadPass,
                    predicted: tuple[float, float, float]) -> list[Residual]:
    fig = next(f for f in run.figures if f.variant == p.variant and f.rate == p.rate)
    p50, p99, tpot = predicted
    out = [Residual("bench-load", name, p.variant, "ttft_p50_s", p50, fig.ttft_p50_s, split),
           Residual("bench-load", name, p.variant, "ttft_p99_s", p99, fig.ttft_p99_s, split)]
    if fig.tpot_median_s:
        out.append(Residual("bench-load", name, p.variant, "tpot_median_s", tpot,
                            fig.tpot_median_s, split))
    return out


def validate_load(box: BoxCosts, results: Path, out: Validation) -> None:
    ablations: dict[str, list[Residual]] = {"no CPU contention": [],
                                            "fresh Poisson send times": []}
    for rel in LOAD_RUNS:
        run = read_load(results / rel)
        label = Path(rel).name + (" (pinned)" if run.pinned else "")
        split = "calibration" if rel == CPU_CALIBRATION_RUN else "validation"
        cpu = box.shared_cpu(run.cpus, run.role_cpus)
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
            if p.send_s is None:
                out.skipped.append(Skipped(label, tag, "send times not rebuilt: the default seed "
                                           "does not give the stored prompt lengths"))
                continue
            variant, own_cap = ALIASES[p.variant]
            dep = _deployment(box, cpu, run.forward_s, run.prompt_tokens, p.input_lens,
                              p.output_lens, p.rate, run.link_bps, own_cap or LOAD_SPEC_CAP)
            name = f"{label} {p.rate:g} req/s"
            out.residuals += _load_residuals(run, name, split, p,
                                             _pass_prediction(dep, variant, p, p.send_s))
            plain = _deployment(box, None, run.forward_s * cpu.forward_alone_rate(),
                                run.prompt_tokens, p.input_lens, p.output_lens, p.rate,
                                run.link_bps, own_cap or LOAD_SPEC_CAP)
            ablations["no CPU contention"] += _load_residuals(
                run, name, split, p, _pass_prediction(plain, variant, p, p.send_s))
            ablations["fresh Poisson send times"] += _load_residuals(
                run, name, split, p, _pass_prediction(dep, variant, p, None))
    out.ablations = ablations


def validate(results: Path) -> tuple[Validation, BoxCosts]:
    results = Path(results)
    box = read_box_costs(results)
    out = Validation()
    validate_ttft(box, results, out)
    validate_load(box, results, out)
    return out, box
