"""The predictions `lynx-sglang plan` prints, from the model: `simulate` (one pass of arrivals,
on dedicated processors (`model.simulate_dedicated`) or on this box's shared ones
(`shared_cpu.simulate_shared`) as the deployment says), a long steady-state run per variant, the
analytic mean TTFT beside it, and the highest rate that meets the SLO.

Called by `tools.plan.cli` (`predict`) and `tools.plan.validate` (`simulate`); it sits above both
`model` and `shared_cpu`, which builds on `model`.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

from ..percentiles import percentile
from .model import (
    PLAN_VARIANTS,
    Arrival,
    Deployment,
    Prediction,
    RequestResult,
    Slo,
    UnstableError,
    Variant,
    VariantPrediction,
    _moments,
    link_unstable_reason,
    one_request_ttft,
    pk_wait,
    poisson_arrivals,
    simulate_dedicated,
    utilisation,
)
from .shared_cpu import simulate_shared


def simulate(dep: Deployment, variant: Variant, arrivals: list[Arrival],
             rng: random.Random) -> list[RequestResult]:
    """Every request of `arrivals` through its prefill (FIFO), the shared link and the decode;
    with `dep.cpu`, event by event with the processors shared (`tools.plan.shared_cpu`)."""
    if dep.cpu is not None:
        return simulate_shared(dep, variant, arrivals, rng)
    return simulate_dedicated(dep, variant, arrivals, rng)


def steady_state(dep: Deployment, variant: Variant, requests: int, seed: int
                 ) -> list[RequestResult]:
    """A long run at dep.rate, the first 10 % (the empty system's warm-up) left out."""
    rng = random.Random(seed)
    results = simulate(dep, variant, poisson_arrivals(dep, requests, rng), rng)
    return results[requests // 10:]


def _pk_mean_ttft(dep: Deployment, variant: Variant) -> float:
    """Analytic mean TTFT: the prefill's P-K wait, the no-queue TTFT, and the link's P-K wait of
    what the first token waits for (FIFO BF16 for mooncake; for Lynx the Anchors, which see only
    other Anchors under preemptive priority). Ignores the prefill's smoothing of link arrivals."""
    f = [dep.forward.seconds(t) for t in dep.prompts]
    w_prefill = pk_wait(dep.rate, *_moments(f))
    first, second = variant.stream_fractions(dep.fractions)
    gating = first if variant.lynx and (variant.speculative or second == 0) else first + second
    wires = [dep.wire_s(t, gating) for t in dep.prompts]
    w_link = pk_wait(dep.decode_rate, *_moments(wires))
    no_queue = statistics.fmean(one_request_ttft(dep, variant, t) for t in dep.prompts)
    return w_prefill + no_queue + w_link


def predict(dep: Deployment, slo: Slo, variants=PLAN_VARIANTS, requests: int = 20000,
            seed: int = 0, search_rate: bool = True) -> Prediction:
    """Per variant: TTFT P50/P99, median time per output token, send-to-last-token P50/P99,
    SLO attainment and goodput at dep.rate, and the highest rate per prefill that still meets
    the SLO for slo.target of requests. Raises UnstableError where the prefill cannot keep up."""
    util = utilisation(dep, variants)
    out = []
    for v in variants:
        reason = link_unstable_reason(dep, v, util)
        if reason is not None:
            out.append(VariantPrediction(v.name, False, reason, util.link[v.name]))
            continue
        rs = steady_state(dep, v, requests, seed)
        ttfts = [r.ttft_s for r in rs]
        tpots = [t for r in rs if (t := r.tpot_s) is not None]
        e2e = [r.last_s for r in rs]
        attained = sum(slo.met(r) for r in rs) / len(rs)
        out.append(VariantPrediction(
            v.name, True, None, util.link[v.name],
            percentile(ttfts, 50), percentile(ttfts, 99), _pk_mean_ttft(dep, v),
            statistics.median(tpots) if tpots else None,
            percentile(e2e, 50), percentile(e2e, 99),
            sum(r.speculated > 0 for r in rs) / len(rs), attained,
            dep.decode_rate * attained,
            max_rate_meeting_slo(dep, v, slo, requests // 4, seed) if search_rate else None))
    return Prediction(util.prefill, util.decode_step_s, out)


def max_rate_meeting_slo(dep: Deployment, variant: Variant, slo: Slo, requests: int,
                         seed: int) -> float | None:
    """Bisection on the per-prefill rate, up to the stability limit of the prefill, the link and
    the decode, for the highest rate whose attainment reaches slo.target (None: not even at a
    vanishing rate)."""
    def meets(rate: float) -> bool:
        d = replace(dep, rate=rate)
        try:
            u = utilisation(d, (variant,))
        except UnstableError:
            return False
        if u.link[variant.name] >= 1:
            return False
        rs = steady_state(d, variant, requests, seed)
        return sum(slo.met(r) for r in rs) / len(rs) >= slo.target

    mean_f = statistics.fmean(dep.forward.seconds(t) for t in dep.prompts)
    hi = 1 / mean_f
    lo = hi * 1e-3
    if not meets(lo):
        return None
    for _ in range(14):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo
