"""`tools.load.stats`: the figures `lynx-sglang bench-load` reports from sglang.bench_serving's
per-request details (pure; the numbers below are worked by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from lynx_tools.load.bench import parse_rates
from lynx_tools.load.stats import LoadFigures, LoadPass, LoadReport, percentile
from lynx_tools.ttft.results import BenchError


def _result(ttfts, itls, texts=None, duration=10.0, errors=None):
    n = len(ttfts)
    return {"input_lens": [500] * n, "output_lens": [len(i) + 1 for i in itls], "ttfts": ttfts,
            "itls": itls, "generated_texts": texts or ["x"] * n, "duration": duration,
            "errors": errors or [""] * n}


@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    list(np.random.default_rng(0).random(37))])
@pytest.mark.parametrize("q", [50, 90, 99])
def test_percentile_is_numpys(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_a_pass_from_bench_serving():
    p = LoadPass.from_bench_serving("lynx", 0.1, _result([1.0, 3.0], [[0.1, 0.3], []]))
    assert p.tpots_s == [pytest.approx(0.2), None]  # one output token: no time per token
    assert p.output_lens == [3, 1]
    f = LoadFigures.of(p, slo_ttft_s=2.0)
    assert (f.ttft_p50_s, f.ttft_max_s, f.tpot_median_s) == (2.0, 3.0, pytest.approx(0.2))
    assert f.slo_attainment == 0.5
    # send to last token: 1.0 + 2 x 0.2 and 3.0 + 0
    assert (f.e2e_p50_s, f.e2e_p99_s) == (pytest.approx(2.2), pytest.approx(1.4 + 1.6 * 0.99))
    assert f.request_throughput == pytest.approx(0.2) and f.output_tokens_per_s == 0.4


def test_a_pass_that_lost_requests_is_an_error():
    with pytest.raises(BenchError, match="1 failed request"):
        LoadPass.from_bench_serving("lynx", 0.1, _result([1.0, 2.0], [[0.1], [0.1]],
                                                         errors=["", "HTTP 500"]))


def _pass(variant, rate, ttfts, texts=None):
    return LoadPass.from_bench_serving(variant, rate,
                                       _result(ttfts, [[0.1, 0.1]] * len(ttfts), texts))


def test_report_compares_variants_per_rate():
    r = LoadReport("mooncake", slo_ttft_s=2.0, slo_target=0.75)
    r.passes += [_pass("mooncake", 0.05, [1.0, 1.5, 1.8, 2.5]),
                 _pass("lynx", 0.05, [0.5, 0.6, 0.7, 0.8]),
                 _pass("mooncake", 0.1, [2.5, 3.0, 3.5, 4.0]),
                 _pass("lynx", 0.1, [0.9, 1.0, 1.1, 2.2], texts=["y"] * 4)]
    assert r.highest_rate_meeting_slo() == {"mooncake": 0.05, "lynx": 0.1}
    ratios = {(x["rate"], x["variant"]): x for x in r.ratios()}
    assert set(ratios) == {(0.05, "lynx"), (0.1, "lynx")}
    assert ratios[(0.05, "lynx")]["p99_ttft"] == pytest.approx(
        percentile([0.5, 0.6, 0.7, 0.8], 99) / percentile([1.0, 1.5, 1.8, 2.5], 99), abs=1e-3)
    assert ratios[(0.05, "lynx")]["tpot"] == 1.0
    assert r.outputs_identical() == {"0.05": True, "0.1": False}
    table = r.table()
    assert "highest rate meeting it: mooncake: 0.05/s, lynx: 0.1/s" in table
    assert r.to_json()["highest_rate_meeting_slo"] == {"mooncake": 0.05, "lynx": 0.1}


def test_no_rate_meets_the_slo():
    r = LoadReport("a", slo_ttft_s=1.0, slo_target=0.9)
    r.passes.append(_pass("a", 0.2, [2.0, 3.0]))
    assert r.highest_rate_meeting_slo() == {"a": None}
    assert "a: none" in r.table()


def test_rates_parse_sorted_and_positive():
    import argparse

    assert parse_rates("0.2, 0.05,0.1") == (0.05, 0.1, 0.2)
    for bad in ("", "0", "-1,2", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)


def test_cpu_per_request_by_role():
    """What each role's servers used in a pass, per request, in the figures and the table;
    a pass measured without it shows none."""
    from dataclasses import replace

    measured = replace(_pass("lynx", 0.1, [1.0, 2.0, 3.0, 4.0]),
                       cpu_s={"prefill": 10.0, "decode": 6.0})
    r = LoadReport("lynx", slo_ttft_s=5.0, slo_target=0.9)
    r.passes += [measured, _pass("lynx", 0.2, [1.0, 2.0])]
    first, second = r.figures()
    assert first.cpu_s_per_request == {"prefill": 2.5, "decode": 1.5}
    assert second.cpu_s_per_request == {}
    assert "2.50+1.50" in r.table()
    assert r.to_json()["passes"][0]["cpu_s"] == {"prefill": 10.0, "decode": 6.0}
