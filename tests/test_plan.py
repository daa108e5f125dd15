"""`lynx-sglang plan` without servers: the queueing model's textbook cases (M/M/1 and M/D/1 waits by
Pollaczek-Khinchine, and the simulation against them), zero load reducing to the one-request
formula, link contention growing with the prefills per decode, argument errors and unstable
queues saying so, and the validation against the stored results within what it claims."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from lynx_tools.cli import main
from lynx_tools.plan.model import (
    INT4_ANCHOR,
    LYNX,
    LYNX_INT8,
    LYNX_INT8_NOSPEC,
    MOONCAKE,
    PRESETS,
    Arrival,
    DecodeStep,
    Deployment,
    ForwardTime,
    PlanError,
    Slo,
    StageCosts,
    UnstableError,
    one_request_ttft,
    pk_wait,
    predict,
    simulate,
    utilisation,
)
from lynx_tools.plan.validate import (
    LOAD_TTFT_MEDIAN_ERROR,
    TOLERANCE,
    validate,
)

RESULTS = Path(__file__).resolve().parents[1] / "results"
SMOL = PRESETS["SmolLM2-135M"]


def _dep(**kw) -> Deployment:
    base = dict(shape=SMOL, prompts=(1000,), outputs=(32,), rate=0.1, link_bps=50e6,
                prefills_per_decode=1, forward=ForwardTime(2e-3), decode=DecodeStep(0.08),
                costs=StageCosts(fixed_s=0.02))
    return Deployment(**(base | kw))


# --- Pollaczek-Khinchine ------------------------------------------------------------------------


def test_pk_wait_is_mm1_and_md1():
    lam, mu = 0.6, 1.0
    rho = lam / mu
    # M/M/1: E[S] = 1/mu, E[S²] = 2/mu²; W = rho / (mu - lam)
    assert pk_wait(lam, 1 / mu, 2 / mu**2) == pytest.approx(rho / (mu - lam))
    # M/D/1: E[S²] = 1/mu²; W = rho / (2 mu (1 - rho))
    assert pk_wait(lam, 1 / mu, 1 / mu**2) == pytest.approx(rho / (2 * mu * (1 - rho)))
    assert pk_wait(0.0, 1.0, 1.0) == 0.0
    with pytest.raises(UnstableError, match="utilisation"):
        pk_wait(1.0, 1.0, 1.0)


def _mean_prefill_wait(dep: Deployment, n: int = 40000) -> float:
    rng = random.Random(1)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(dep.rate)
        arrivals.append(Arrival(t, 0, rng.choice(dep.prompts), 1))
    results = simulate(dep, MOONCAKE, arrivals, rng)[n // 10:]
    return statistics.fmean(r.prefill_wait_s for r in results)


def test_simulated_prefill_queue_matches_md1():
    dep = _dep(rate=0.35, forward=ForwardTime(2e-3))  # every forward 2 s: rho 0.7
    expected = pk_wait(0.35, 2.0, 4.0)
    assert _mean_prefill_wait(dep) == pytest.approx(expected, rel=0.08)


def test_simulated_prefill_queue_matches_mm1():
    rng = random.Random(2)
    prompts = tuple(max(1, round(rng.expovariate(1 / 1000))) for _ in range(20000))
    dep = _dep(prompts=prompts, rate=0.3, forward=ForwardTime(2e-3))  # mean forward 2 s
    s = [dep.forward.seconds(t) for t in prompts]
    expected = pk_wait(0.3, statistics.fmean(s), statistics.fmean(x * x for x in s))
    assert expected == pytest.approx(0.6 / (0.5 - 0.3), rel=0.03)  # rho / (mu - lambda)
    assert _mean_prefill_wait(dep) == pytest.approx(expected, rel=0.1)


# --- zero load, contention -----------------------------------------------------------------------


@pytest.mark.parametrize("link_bps", [10e6, 50e6, 1e9, 25e9])
@pytest.mark.parametrize("variant", [MOONCAKE, LYNX, LYNX_INT8, LYNX_INT8_NOSPEC, INT4_ANCHOR])
def test_zero_load_is_the_one_request_formula(variant, link_bps):
    costs = StageCosts(fixed_s=0.02, encode_exact_s_per_byte=2e-9, encode_int8_s_per_byte=5e-10,
                       apply_exact_s_per_byte=1e-9, apply_int8_s_per_byte=5e-10)
    dep = _dep(link_bps=link_bps, costs=costs)
    arrivals = [Arrival(i * 1e6, 0, 1000, 32) for i in range(5)]
    for r in simulate(dep, variant, arrivals, random.Random(0)):
        assert r.prefill_wait_s == 0
        assert r.ttft_s == pytest.approx(one_request_ttft(dep, variant, 1000), abs=1e-9)


def test_one_request_formula_by_hand():
    dep = _dep(link_bps=10e6)  # 1000 tokens: 23.04 MB BF16, 18.4 s of wire; forward 2 s
    wire = 1000 * 23040 * 8 / 10e6
    assert one_request_ttft(dep, MOONCAKE, 1000) == pytest.approx(2 + wire + 0.02)
    # Layer-streamed Anchor: the wire starts with the forward and outlasts it.
    assert one_request_ttft(dep, LYNX, 1000) == pytest.approx(0.296 * wire + 0.02)
    assert one_request_ttft(dep, LYNX_INT8_NOSPEC, 1000) == pytest.approx(0.546 * wire + 0.02)


def test_more_prefills_per_decode_more_link_contention():
    waits, busy = [], []
    for n in (1, 2, 4):
        dep = _dep(rate=0.05, prefills_per_decode=n, link_bps=100e6)
        busy.append(utilisation(dep, (MOONCAKE,)).link["mooncake"])
        pred = predict(dep, Slo(10.0), (MOONCAKE, LYNX), requests=4000, search_rate=False)
        waits.append(pred.variants[0].ttft_p99_s)
    assert busy == pytest.approx([0.05 * 1.8432 * n for n in (1, 2, 4)], rel=1e-3)
    assert waits[0] < waits[1] < waits[2]


def test_speculative_tokens_wait_for_the_residual():
    dep = _dep(link_bps=10e6)
    rs = simulate(dep, LYNX, [Arrival(0.0, 0, 1000, 32)], random.Random(0))
    r = rs[0]
    assert r.speculated > 0 and r.release_s is not None
    residual_wire = 1000 * 23040 * (0.735 - 0.296) * 8 / 10e6  # 8.1 s after the Anchor
    assert r.token_s(2) == r.release_s > r.ttft_s + residual_wire
    assert r.tpot_s > dep.decode.base_s


# --- errors and unstable queues ------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    ({"rate": -1.0}, "rate must be >= 0"),
    ({"link_bps": 0.0}, "link must be faster"),
    ({"prefills_per_decode": 0}, "prefills per decode"),
    ({"prompts": ()}, "prompt lengths"),
])
def test_deployment_errors(kw, message):
    with pytest.raises(PlanError, match=message):
        _dep(**kw)


def test_rate_beyond_the_prefill_says_unstable():
    with pytest.raises(UnstableError, match=r"unstable.*at most 0\.5 req/s"):
        predict(_dep(rate=0.6), Slo(10.0), requests=200)


def test_a_link_that_cannot_keep_up_is_unstable_for_that_variant_only():
    pred = predict(_dep(rate=0.4, link_bps=60e6), Slo(10.0), requests=2000, search_rate=False)
    by = {v.variant: v for v in pred.variants}
    assert not by["mooncake"].stable and "unstable" in by["mooncake"].reason
    assert by["mooncake"].ttft_p50_s is None
    assert by["lynx-int8"].stable and by["lynx-int8"].ttft_p50_s is not None


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "Llama-3-8B", "--rate", "-0.5"])
    assert e.value.code == 2
    assert "--rate must not be negative" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--layers", "32"])
    assert "--kv-heads" in capsys.readouterr().err
    assert main(["plan", "--model", "Llama-3-8B", "--rate", "50", "--requests", "200"]) == 2
    assert "unstable" in capsys.readouterr().err


def test_cli_prediction(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "Llama-3-8B", "--prompt-tokens", "8000", "--rate", "0.5",
                 "--link-gbps", "10", "--requests", "400", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "PREDICTION" in table and "lynx-int8" in table
    doc = json.loads(out.read_text())
    variants = {v["variant"]: v for v in doc["prediction"]["variants"]}
    assert set(variants) == {"mooncake", "lynx", "lynx-int8"}
    assert variants["lynx"]["ttft_p50_s"] < variants["mooncake"]["ttft_p50_s"]


# --- validation ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validation():
    return validate(RESULTS)


def test_validation_single_request_within_tolerance(validation):
    result, _ = validation
    ttft = [r for r in result.residuals if r.source == "bench-ttft" and not r.calibration]
    assert len(ttft) >= 80
    worst = max(ttft, key=lambda r: abs(r.rel_error))
    assert abs(worst.rel_error) <= TOLERANCE, worst


def test_validation_under_load_as_claimed(validation):
    result, _ = validation
    load = [r for r in result.residuals if r.source == "bench-load"
            and r.metric.startswith("ttft")]
    assert statistics.median(abs(r.rel_error) for r in load) <= LOAD_TTFT_MEDIAN_ERROR
    assert sum(r.rel_error < 0 for r in load) >= 0.8 * len(load)  # the stated bias: low


def test_stored_validation_is_current(validation):
    result, _ = validation
    stored = json.loads((RESULTS / "plan" / "validation.json").read_text())
    assert stored["summary"] == result.summary()
