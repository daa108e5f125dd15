"""`lynx-sglang plan` without servers: the queueing model's textbook cases (M/M/1 and M/D/1 waits by
Pollaczek-Khinchine, and the simulation against them), zero load reducing to the one-request
formula, link contention growing with the prefills per decode, the shared-CPU model of this box
(ample cores reducing to no contention, the scheduler's share by session, more demand taking
longer, its demands from the stored CPU seconds), the rebuilt send times, argument errors and
unstable queues saying so, and the validation against the stored results within what it
claims."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace
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
    CpuDemand,
    DecodeClock,
    DecodeStep,
    Deployment,
    ForwardTime,
    PlanError,
    SharedCpu,
    Slo,
    StageCosts,
    UnstableError,
    one_request_ttft,
    pk_wait,
    poisson_arrivals,
    utilisation,
)
from lynx_tools.plan.predict import predict, simulate
from lynx_tools.plan.stored import read_load, send_times
from lynx_tools.plan.validate import (
    LOAD_MEDIAN_ERROR,
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


# --- the shared CPU (this box) --------------------------------------------------------------------

BOX_DEMAND = CpuDemand(forward=1.7, decode=1.0, bf16_sender=1.0)
CODEC = StageCosts(fixed_s=0.02, encode_exact_s_per_byte=2e-9, encode_int8_s_per_byte=5e-10,
                   apply_exact_s_per_byte=1e-9, apply_int8_s_per_byte=5e-10)


def _loaded(dep: Deployment, n: int = 40) -> list[Arrival]:
    return poisson_arrivals(dep, n, random.Random(3))


@pytest.mark.parametrize("variant", [MOONCAKE, LYNX, LYNX_INT8, LYNX_INT8_NOSPEC, INT4_ANCHOR])
@pytest.mark.parametrize("link_bps", [10e6, 50e6, 1e9])
def test_a_core_per_activity_is_no_contention(variant, link_bps):
    """Pinned, with as many cores per role as its activities can ask for at once (a core each):
    every rate is 1 and the event-by-event simulation is the plain one, token for token."""
    dep = _dep(prompts=(500, 800, 1000), outputs=(8, 32), rate=0.3, link_bps=link_bps,
               costs=CODEC)
    ample = replace(dep, cpu=SharedCpu(CpuDemand(1.0, 1.0, 1.0), 64, True, 40, 40))
    arrivals = _loaded(dep)
    plain = simulate(dep, variant, arrivals, random.Random(5))
    shared = simulate(ample, variant, arrivals, random.Random(5))
    assert any(r.prefill_wait_s > 0 for r in plain)  # a loaded pass, queues and all
    for a, b in zip(plain, shared, strict=True):
        assert (a.speculated, a.accepted) == (b.speculated, b.accepted)
        for k in (1, 2, a.outputs):
            assert b.token_s(k) == pytest.approx(a.token_s(k), abs=1e-9)


def test_share_by_session():
    """Two sessions (prefill, decode) on 2 cores, max-min fair between them, proportional
    within: the forward and the decode each get a core when both want more; a decode asking
    for less leaves the rest to the forward; pinned, a role has its own cores only."""
    box = SharedCpu(BOX_DEMAND, 2)
    assert box.rates({"prefill": 1.7, "decode": 0.0}) == {"prefill": 1.0, "decode": 1.0}
    assert box.rates({"prefill": 1.7, "decode": 1.0}) == pytest.approx(
        {"prefill": 1 / 1.7, "decode": 1.0})
    assert box.rates({"prefill": 2.7, "decode": 0.5}) == pytest.approx(
        {"prefill": 1.5 / 2.7, "decode": 1.0})
    assert box.forward_alone_rate() == 1.0
    pinned = SharedCpu(BOX_DEMAND, 2, True, 1, 1)
    assert pinned.rates({"prefill": 1.7, "decode": 0.0})["prefill"] == pytest.approx(1 / 1.7)
    assert pinned.forward_alone_rate() == pytest.approx(1 / 1.7)
    with pytest.raises(PlanError):
        SharedCpu(BOX_DEMAND, 2, True, 0, 1)


@pytest.mark.parametrize("prefill, decode", [(0.5, 0.0), (1.5, 1.0), (2.5, 1.2), (4.0, 3.0)])
def test_more_demand_slower(prefill, decode):
    box = SharedCpu(BOX_DEMAND, 2)
    base = box.rates({"prefill": prefill, "decode": decode})
    for more in ({"prefill": prefill + 0.5, "decode": decode},
                 {"prefill": prefill, "decode": decode + 0.5}):
        rates = box.rates(more)
        assert all(rates[r] <= base[r] + 1e-12 for r in rates)


def _mean_ttft(dep: Deployment, variant) -> float:
    return statistics.fmean(r.ttft_s for r in simulate(dep, variant, _loaded(dep),
                                                       random.Random(0)))


def test_more_demand_longer_times():
    """Under load the contention lengthens TTFT, the more so the more each activity asks; a
    mooncake forward slows while its polling sender has BF16 bytes on the wire."""
    dep = _dep(prompts=(500, 800, 1000), rate=0.25, link_bps=100e6, costs=CODEC)
    plain = _mean_ttft(dep, MOONCAKE)
    times = [_mean_ttft(replace(dep, cpu=SharedCpu(CpuDemand(f, d, s), 2)), MOONCAKE)
             for f, d, s in ((1.7, 1.0, 0.0), (1.7, 1.0, 1.0), (2.0, 1.0, 1.0), (2.0, 1.5, 1.5))]
    assert plain < times[0] < times[1] < times[2] < times[3]
    lynx = [_mean_ttft(replace(dep, cpu=cpu), LYNX) for cpu in (
        None, SharedCpu(CpuDemand(1.7, 1.0, 1.0), 2), SharedCpu(CpuDemand(1.7, 1.5, 1.0), 2))]
    assert lynx[0] < lynx[1] < lynx[2]  # its forwards slow while the decode steps


def test_decode_clock_follows_the_rate():
    clock = DecodeClock()
    clock.advance(1.0, 1.0)
    clock.advance(3.0, 0.5)  # 1 s of steps in these 2 s
    assert clock.after(0.0, 1.5) == pytest.approx(2.0)
    assert clock.after(0.5, 2.0) == pytest.approx(4.5 - 1.0)  # 0.5 + 1 s + 0.5 s past the end
    r = simulate(replace(_dep(costs=CODEC), cpu=SharedCpu(BOX_DEMAND, 2)), MOONCAKE,
                 [Arrival(0.0, 0, 1000, 32)], random.Random(0))[0]
    assert r.tpot_s == pytest.approx(0.08)  # alone: the decode's demand fits its core


def test_send_times_rebuilt_from_the_seed():
    lens, outs, sends = send_times(8, 1000, 0.5, 32, 0.05)
    assert lens == [602, 935, 848, 770, 606, 571, 688, 520]
    assert outs == [22, 26, 26, 19, 23, 18, 17, 27]
    assert sends[0] == 0.0 and sends[1] == pytest.approx(11.31, abs=0.01)
    for path in (RESULTS / "bench_load").glob("*.json"):
        run = read_load(path)
        for p in run.passes:
            if run.workload == "random":
                assert p.send_s is not None, (path.name, p.variant)
                assert p.duration_s >= p.send_s[-1]


def test_cpu_demands_from_the_stored_cpu_seconds():
    """The calibration run's demands: a forward keeps ~1.7 cores busy, the decode one, mooncake's
    sender one while its bytes cross; the held-out R4 run's CPU seconds say the same within
    10 %."""
    from lynx_tools.plan.box import cpu_demand_of, read_box_costs

    got = read_box_costs(RESULTS).cpu_demand
    assert 1.5 < got.forward < 2.0 and 0.9 < got.decode < 1.2 and 0.8 < got.bf16_sender < 1.1
    held_out = cpu_demand_of(read_load(
        RESULTS / "bench_load" / "bench_load_R4_four_variants_2026-12-07.json"))
    for name in ("forward", "decode", "bf16_sender"):
        assert getattr(held_out, name) == pytest.approx(getattr(got, name), rel=0.1)


# --- validation ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validation():
    return validate(RESULTS)


def test_validation_single_request_within_tolerance(validation):
    result, _ = validation
    ttft = [r for r in result.of("validation") if r.source == "bench-ttft"]
    assert len(ttft) >= 80
    worst = max(ttft, key=lambda r: abs(r.rel_error))
    assert abs(worst.rel_error) <= TOLERANCE, worst


def test_validation_under_load_as_claimed(validation):
    result, _ = validation
    load = [r for r in result.of("validation") if r.source == "bench-load"]
    assert len(load) >= 70
    for metric, bound in LOAD_MEDIAN_ERROR.items():
        errs = [abs(r.rel_error) for r in load if r.metric == metric]
        assert statistics.median(errs) <= bound, metric


def test_each_load_mechanism_brings_the_model_closer(validation):
    """Without the CPU contention, or without the passes' own send times, the TTFTs miss more."""
    result, _ = validation
    ours = {(r.metric, r.run, r.variant): abs(r.rel_error) for r in result.of("validation")
            if r.source == "bench-load"}
    for name, residuals in result.ablations.items():
        for metric in ("ttft_p50_s", "ttft_p99_s"):
            less = [abs(r.rel_error) for r in residuals
                    if r.split == "validation" and r.metric == metric]
            full = [e for (m, _, _), e in ours.items() if m == metric]
            assert statistics.median(full) < statistics.median(less), (name, metric)


def test_stored_validation_is_current(validation):
    result, box = validation
    stored = json.loads((RESULTS / "plan" / "validation.json").read_text())
    doc = result.to_json(box)
    for key in ("summary", "summary_validation", "summary_calibration", "ablations"):
        assert stored[key] == doc[key], key
