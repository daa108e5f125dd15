"""Percentiles as the benchmarks report them: linear interpolation between closest ranks (numpy's
default, as sglang.bench_serving reports its own). Pure Python, so the planner (`tools.plan`)
shares it with bench-load's statistics (`tools.load.stats`) without importing the latter's torch.
"""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
