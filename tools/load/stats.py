"""What one pass of Poisson arrivals gave a variant (`LoadPass`, from sglang.bench_serving's
`--output-details` result), the serving figures an operator sizes a deployment by (P50/P99 TTFT,
time per output token, throughput, SLO attainment), and the report across rates and variants.

Pure (no servers). Called by `tools.load.bench`, which runs the passes.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ..percentiles import percentile
from ..ttft.results import BenchError


@dataclass(frozen=True)
class LoadPass:
    """One variant's requests at one arrival rate: per request (in prompt order) its prompt
    length, output length, TTFT and time per output token after the first (None for one token),
    and the whole pass's wall time."""

    variant: str
    rate: float
    input_lens: list[int]
    output_lens: list[int]
    ttfts_s: list[float]
    tpots_s: list[float | None]
    texts: list[str]
    duration_s: float
    # CPU seconds each role's servers used during the pass ("prefill", "decode"), when measured.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_bench_serving(cls, variant: str, rate: float, result: dict) -> LoadPass:
        """From one bench_serving `--output-details` result line; BenchError if any request
        failed (a pass under load that lost requests measures nothing comparable)."""
        errors = [e for e in result.get("errors", []) if e]
        if errors:
            raise BenchError(f"{variant} at {rate:g} req/s: bench_serving: {len(errors)} failed "
                             f"request(s): {errors[0][-2000:]}")
        tpots = [sum(itl) / (out - 1) if out > 1 else None
                 for itl, out in zip(result["itls"], result["output_lens"], strict=True)]
        return cls(variant, rate, list(result["input_lens"]), list(result["output_lens"]),
                   list(result["ttfts"]), tpots, list(result["generated_texts"]),
                   float(result["duration"]))


@dataclass(frozen=True)
class LoadFigures:
    """The serving figures of one `LoadPass` against a TTFT bound (the SLO)."""

    variant: str
    rate: float
    requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_max_s: float
    tpot_median_s: float | None
    # Send to last token: a speculative variant moves part of its wait from TTFT into its first
    # inter-token gaps (verified tokens wait for the exact KV), which TPOT alone would charge it
    # twice for; the whole latency says what the user waited.
    e2e_p50_s: float
    e2e_p99_s: float
    request_throughput: float
    output_tokens_per_s: float
    slo_attainment: float
    # CPU seconds per request of each role's servers (what the pass used, over its requests):
    # on a box where prefill and decode share cores, one role's work slows the other's steps.
    cpu_s_per_request: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, p: LoadPass, slo_ttft_s: float) -> LoadFigures:
        tpots = [t for t in p.tpots_s if t is not None]
        e2e = [ttft + (tpot or 0.0) * (out - 1)
               for ttft, tpot, out in zip(p.ttfts_s, p.tpots_s, p.output_lens, strict=True)]
        return cls(p.variant, p.rate, len(p.ttfts_s), percentile(p.ttfts_s, 50),
                   percentile(p.ttfts_s, 99), max(p.ttfts_s),
                   statistics.median(tpots) if tpots else None,
                   percentile(e2e, 50), percentile(e2e, 99),
                   len(p.ttfts_s) / p.duration_s, sum(p.output_lens) / p.duration_s,
                   sum(t <= slo_ttft_s for t in p.ttfts_s) / len(p.ttfts_s),
                   {role: round(cpu / len(p.ttfts_s), 3) for role, cpu in p.cpu_s.items()})


@dataclass
class LoadReport:
    """Every pass of a run, the bound, and what compares them."""

    baseline: str
    slo_ttft_s: float
    slo_target: float  # the share of requests within the bound that "meets the SLO"
    passes: list[LoadPass] = field(default_factory=list)

    def figures(self) -> list[LoadFigures]:
        return [LoadFigures.of(p, self.slo_ttft_s) for p in self.passes]

    def highest_rate_meeting_slo(self) -> dict[str, float | None]:
        """Per variant, the highest rate run at which its SLO attainment reached the target
        (None: none did)."""
        best: dict[str, float | None] = {}
        for f in self.figures():
            best.setdefault(f.variant, None)
            if f.slo_attainment >= self.slo_target and (best[f.variant] or 0) < f.rate:
                best[f.variant] = f.rate
        return best

    def ratios(self) -> list[dict]:
        """Per rate and variant: its P99 TTFT, P50 TTFT and median TPOT over the baseline's."""
        figs = {(f.rate, f.variant): f for f in self.figures()}
        out = []
        for (rate, name), f in figs.items():
            base = figs.get((rate, self.baseline))
            if base is None or name == self.baseline:
                continue
            out.append({"rate": rate, "variant": name,
                        "p99_ttft": _ratio(f.ttft_p99_s, base.ttft_p99_s),
                        "p50_ttft": _ratio(f.ttft_p50_s, base.ttft_p50_s),
                        "tpot": _ratio(f.tpot_median_s, base.tpot_median_s),
                        "p99_e2e": _ratio(f.e2e_p99_s, base.e2e_p99_s)})
        return out

    def outputs_identical(self) -> dict[str, bool]:
        """Per rate: whether every variant returned the baseline's text for every prompt
        (greedy, the same prompts; a lossy variant is expected to differ)."""
        by_rate: dict[float, list[LoadPass]] = {}
        for p in self.passes:
            by_rate.setdefault(p.rate, []).append(p)
        return {f"{rate:g}": len({tuple(p.texts) for p in ps}) == 1
                for rate, ps in by_rate.items()}

    def to_json(self) -> dict:
        return {"baseline": self.baseline, "slo_ttft_s": self.slo_ttft_s,
                "slo_target": self.slo_target,
                "figures": [asdict(f) for f in self.figures()],
                "ratios_to_baseline": self.ratios(),
                "highest_rate_meeting_slo": self.highest_rate_meeting_slo(),
                "outputs_identical_per_rate": self.outputs_identical(),
                "passes": [asdict(p) for p in self.passes]}

    def table(self) -> str:
        head = (f"{'rate/s':>7} {'variant':<18} {'n':>3} {'TTFT p50':>9} {'p99':>8} "
                f"{'max':>8} {'TPOT':>8} {'e2e p99':>8} {'req/s':>6} {'tok/s':>7} {'SLO':>5} "
                f"{'CPU s/req P+D':>13}")
        rows = [head, "-" * len(head)]
        for f in sorted(self.figures(), key=lambda f: (f.rate, f.variant != self.baseline)):
            tpot = "-" if f.tpot_median_s is None else f"{f.tpot_median_s * 1000:.0f} ms"
            rows.append(f"{f.rate:>7g} {f.variant:<18} {f.requests:>3} {f.ttft_p50_s:>8.2f}s "
                        f"{f.ttft_p99_s:>7.2f}s {f.ttft_max_s:>7.2f}s {tpot:>8} "
                        f"{f.e2e_p99_s:>7.2f}s "
                        f"{f.request_throughput:>6.3f} {f.output_tokens_per_s:>7.1f} "
                        f"{f.slo_attainment:>5.0%} {_cpu_cell(f.cpu_s_per_request):>13}")
        best = ", ".join(f"{v}: {'none' if r is None else f'{r:g}/s'}"
                         for v, r in self.highest_rate_meeting_slo().items())
        rows.append(f"SLO: TTFT <= {self.slo_ttft_s:.2f} s for >= {self.slo_target:.0%} of "
                    f"requests; highest rate meeting it: {best}")
        return "\n".join(rows)


def _cpu_cell(per_request: dict[str, float]) -> str:
    if not per_request:
        return "-"
    return f"{per_request.get('prefill', 0):.2f}+{per_request.get('decode', 0):.2f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)
