"""Which of the long end-to-end test modules a sampled run executes (`LYNX_TEST_SAMPLE=ci`).

CI (`scripts/test.sh`) runs every fast test and a sample of the modules that each start their own
SGLang PD cluster (1-5 min each on 2 cores), so that `.ci/run` stays near its 30-minute budget;
`LYNX_TEST_SAMPLE=all` (the default when pytest is run by hand) runs everything. The modules in
`ALWAYS` run every time (the core claims: exact greedy output through real PD, speculation with
rollback); of `SAMPLED` a fixed number run, and each of `OCCASIONAL` with its probability. The
draw is seeded by `LYNX_TEST_SEED` (scripts/test.sh passes the commit), so a run can be repeated
exactly and successive commits cover every module. A module sampled out is reported as skipped with the seed
and the command that runs it. Hooked in by tests/conftest.py; docs/testing.md lists what runs where.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

SAMPLE_ENV = "LYNX_TEST_SAMPLE"
SEED_ENV = "LYNX_TEST_SEED"
TESTS = Path(__file__).resolve().parent

# Always run, sampled or not.
ALWAYS = frozenset({
    "sglang/test_pd_lynx.py",
    "sglang/test_pd_lynx_spec.py",
})
# Of these, a sampled run executes SAMPLED_PER_RUN, drawn without replacement (a bounded cost).
SAMPLED = (
    "sglang/test_pd_lynx_int8.py",
    "sglang/test_pd_lynx_chunked.py",
    "sglang/test_pd_lynx_sampling.py",
    "sglang/test_pd_lynx_tls.py",
    "sglang/test_pd_lynx_windowed.py",
    "sglang/test_pd_mooncake_baseline.py",
    "sglang/test_load.py",
    "sglang/test_fault_matrix.py",
    "sglang/test_pd_lynx_overlap.py",
    "sglang/test_pd_lynx_paged.py",
    "sglang/test_pd_lynx_tp.py",
    "sglang/test_pd_lynx_mla.py",
    "sglang/test_pd_lynx_mla_tp.py",
)
SAMPLED_PER_RUN = 2
# Each runs with its own probability: one request through real SGLang servers inside the
# soft-RoCE guest takes ~13 min under emulation, the whole rest of the guest stage ~5.
OCCASIONAL = {"sglang/test_pd_lynx_verbs.py": 0.25}


def mode() -> str:
    value = os.environ.get(SAMPLE_ENV, "all")
    if value not in ("all", "ci"):
        raise pytest.UsageError(f"${SAMPLE_ENV} must be 'all' or 'ci', got {value!r}")
    return value


def seed() -> str:
    return os.environ.get(SEED_ENV) or "unseeded"


def chosen(seed_text: str) -> set[str]:
    """The SAMPLED and OCCASIONAL modules a run with this seed executes (the same seed, the same
    choice)."""
    rng = random.Random(seed_text)
    picked = set(rng.sample(SAMPLED, SAMPLED_PER_RUN))
    picked |= {m for m, p in sorted(OCCASIONAL.items()) if rng.random() < p}
    return picked


def pytest_report_header(config) -> str | None:
    if mode() != "ci":
        return None
    runs = sorted(chosen(seed()))
    return (f"lynx sampled run (seed {seed()}): long modules {sorted(ALWAYS)} always, of the "
            f"sampled ones {runs or 'none'}; {SAMPLE_ENV}=all runs every module")


def pytest_collection_modifyitems(config, items) -> None:
    if mode() != "ci":
        return
    runs = chosen(seed())
    for item in items:
        module = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
        if (module in SAMPLED or module in OCCASIONAL) and module not in runs:
            item.add_marker(pytest.mark.skip(
                reason=f"sampled out of this CI run (seed {seed()}); "
                       f"{SAMPLE_ENV}=all or `pytest tests/{module}` runs it"))
