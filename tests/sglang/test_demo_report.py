"""The demo's report on canned bench-ttft results (tools/demo/report.py), no servers: the headline
(TTFT from the send and the 16th / 64th token against the baseline, R and the GPU deployments it
stands for, the interleaving), the fairness warning when the prefill forwards differ by more than
10 %, the outputs' verdict and exit status, the fast-link line, demo.json and the timeline PNG;
and the demo's command line (variants, the plan for the link)."""

from __future__ import annotations

import argparse
import json

import pytest

from lynx_sglang.names import IDLE_WAIT_ENV
from lynx_tools.demo import run as demo
from lynx_tools.demo.report import (
    FAST_LINK_WORDS,
    DemoRun,
    compare,
    demo_json,
    exit_status,
    fairness,
    format_report,
    label,
    marks_by_time,
    plot_timeline,
)
from lynx_tools.measure import kv_dtype_server_args, model_kv_shape
from lynx_tools.prompts import passkey_prompt
from lynx_tools.ttft.regime import HEARTBEAT_ENV, Calibration, Regime, link_rate_for
from lynx_tools.ttft.results import LYNX_CLIENT, BenchConfig, RequestTiming, VariantResult
from lynx_tools.variants import select_variants

KV_BYTES = 1500 * 23040  # SmolLM2-135M's BF16 KV of a 1500-token prompt
MOON, LYNX, INT8 = select_variants("mooncake-nospin,lynx,lynx-int8")


def _cfg(link: str | None = "21000kbit") -> BenchConfig:
    return BenchConfig(link, "/m", 1500, 64, 2, 42, (16, 64),
                       ("mooncake-nospin", "lynx", "lynx-int8"), "mooncake-nospin", 300.0, 180.0,
                       use_bench_serving=False, interleave=True)


def _request(i: int, forward: float, ttft: float, t16: float, t64: float, text: str = "same",
             lynx: bool = True) -> RequestTiming:
    events = ({"anchor_landed": forward + 0.5, "anchor_applied": forward + 0.6,
               "residual_landed": t16 - 0.3, "residual_applied": t16 - 0.2} if lynx else {})
    return RequestTiming(LYNX_CLIENT, i, 1500, 64, ttft, {16: t16, 64: t64},
                         prefill_done_s=forward, network_ttft_s=round(ttft - forward, 6),
                         stream_bytes={"anchor": 10 << 20, "residual": 15 << 20} if lynx else None,
                         lynx_events_s=events,
                         speculation={"speculated": 60, "accepted": 60, "rolled_back": 0}
                         if lynx else None, text=text)


def _results(moon_forward: float = 3.4, lynx_text: str = "same", int8_text: str = "other",
             failed: tuple = ()) -> list[VariantResult]:
    moon = [_request(i, moon_forward, 17.0 + i * 0.2, 18.6, 23.2, lynx=False) for i in range(2)]
    lynx = [_request(i, 3.3, 4.1, 10.3, 13.4, text=lynx_text) for i in range(2)]
    int8 = [_request(i, 3.2, 4.0, 7.2, 10.0, text=int8_text) for i in range(2)]
    return [VariantResult(MOON, moon, {"kv": KV_BYTES}, False, None, "/r/m"),
            VariantResult(LYNX, lynx, {"anchor": 10 << 20, "residual": 15 << 20}, True, None,
                          "/r/l"),
            VariantResult(INT8, int8, {"anchor": 10 << 20, "residual": 8 << 20}, True, None,
                          "/r/i", failed=failed)]


def _regime_run(results: list[VariantResult], r: float = 4.0) -> DemoRun:
    rate = link_rate_for(r, KV_BYTES, 3.3)
    cfg = _cfg(rate.tc)
    regime = Regime(rate, Calibration("mooncake-nospin", ("a", "b"), (3.5, 3.3)), KV_BYTES, cfg,
                    results)
    return DemoRun("shaped", rate.bps, KV_BYTES, cfg, results, regime)


def test_the_headline_is_ttft_from_the_send_and_the_token_marks_against_the_baseline():
    report = format_report([_regime_run(_results())])
    # R achieved from the baseline's own forward (3.4 s), and what it stands for on GPUs.
    assert report.startswith("R = 3.9 (the BF16 KV's wire time "), report
    assert "shaped for R 4 from a 3.30 s calibration forward" in report
    assert "on GPUs that is about (estimates, docs/benchmarks.md): " in report
    assert report.count("(estimate)") == 2
    assert "interleaved round by round with all 3 clusters up" in report
    assert ("TTFT from the send: mooncake-nospin 17.10 s -> lynx 4.10 s (4.17× sooner), "
            "lynx-int8 4.00 s (4.28× sooner)") in report
    assert "token 16 from the send: mooncake-nospin 18.60 s -> lynx 10.30 s (1.81× sooner)" in report
    assert "token 64 from the send: mooncake-nospin 23.20 s -> lynx 13.40 s" in report
    row = next(ln for ln in report.splitlines() if ln.startswith("  lynx "))
    for cell in ("Lynx exact", "3.30 s", "4.10 s", "10.30 s", "25.0 MiB", "60/60/0, 60/60/0"):
        assert cell in row, row
    assert "SGLang mooncake_tcp" in report and "Lynx int8 (lossy)" in report
    assert "fair: every variant's prefill forward within 10 %" in report
    assert "NOT A FAIR" not in report
    # Lynx identical to the baseline; the lossy INT8 target is only reported.
    assert ("outputs against mooncake-nospin's, prompt by prompt: lynx identical; "
            "lynx-int8 (lossy) other text") in report
    # No fast link measured: the README's words and measurement, and the command for it.
    assert f"On a fast link, {FAST_LINK_WORDS} (README: measured at 1 Gbit/s" in report
    assert "`lynx-sglang demo --regime 0.06` measures it here" in report


def test_forwards_more_than_10_percent_apart_are_called_unfair_and_why():
    run = _regime_run(_results(moon_forward=4.0))
    fair = fairness(run)
    assert not fair.fair and fair.spread == pytest.approx(4.0 / 3.2 - 1)
    text = format_report([run])
    assert "NOT A FAIR COMPARISON: the prefill forwards differ by 25 %" in text
    assert "mooncake-nospin's TTFT carries 0.80 s more forward than lynx-int8's" in text
    assert "the comparison leans towards lynx-int8" in text
    assert "TTFT from the send includes the forward" in text
    # Within 10 %: fair.
    assert fairness(_regime_run(_results(moon_forward=3.5))).fair


def test_a_fast_link_reads_even_in_the_readmes_words():
    # 1 Gbit/s against a 3.4 s forward: R ≈ 0.08, every TTFT within 10 % of the baseline's.
    results = _results()
    fast = [VariantResult(r.variant, [_request(q.index, q.prefill_done_s, 3.7, 5.0, 9.0,
                                               text=q.text, lynx=r.variant.name != "mooncake-nospin")
                                      for q in r.requests],
                          r.stream_bytes, r.bytes_measured, None, r.run_dir) for r in results]
    run = DemoRun("1gbit", 1e9, KV_BYTES, _cfg("1gbit"), fast)
    text = format_report([run])
    assert "R = 0.081" in text and "link 1.00 Gbit/s, a fixed rate (--link)" in text
    assert "lynx 3.70 s (even (1.00×))" in text
    assert f"a fast link: {FAST_LINK_WORDS}" in text
    assert "On a fast link" not in text  # measured here: no quote from the README
    assert compare(4.0, 4.3) == "even (0.93×)" and compare(4.0, 5.0) == "1.25× later"


def test_loopback_says_r_is_unknown():
    run = DemoRun("loopback, bfloat16 KV", None, KV_BYTES, _cfg(None), _results())
    text = format_report([run])
    assert text.startswith("no shaped link (loopback, bfloat16 KV): R unknown")
    assert "on GPUs" not in text


def test_exit_status_fails_on_different_exact_outputs_or_a_failed_request():
    assert exit_status([_regime_run(_results())]) == 0
    differs = _regime_run(_results(lynx_text="different"))
    assert exit_status([differs]) == 1
    assert "lynx NOT IDENTICAL" in format_report([differs])
    failed = _regime_run(_results(failed=({"prompt": 1, "rid": "x", "error": "HTTP 500"},)))
    assert exit_status([failed]) == 1
    assert "lynx-int8: 1 request(s) FAILED, left out: prompt 1: HTTP 500" in format_report([failed])


def test_demo_json_has_the_headline_fairness_and_bench_ttfts_record(tmp_path):
    doc = json.loads(json.dumps(demo_json([_regime_run(_results())], {"wall_s": 1.0})))
    (run,) = doc["runs"]
    assert run["r_target"] == 4.0 and run["r_achieved"] == pytest.approx(
        KV_BYTES * 8 / link_rate_for(4.0, KV_BYTES, 3.3).bps / 3.4)
    assert run["headline"]["lynx"]["ttft_s"] == pytest.approx(4.1)
    assert run["headline"]["mooncake-nospin"]["t64_s"] == pytest.approx(23.2)
    assert run["fair"] is True and run["exact_outputs_identical"] is True
    assert run["forwards_s"] == {"mooncake-nospin": 3.4, "lynx": 3.3, "lynx-int8": 3.2}
    assert run["detail"]["r_target"] == 4.0  # bench-ttft --regime's own record
    assert "lynx" in run["detail"]["bench"]["variants"]
    assert doc["fast_link_note"] and doc["wall_s"] == 1.0


def test_token_marks_released_together_share_one_label():
    assert marks_by_time({16: 13.27, 64: 13.3}) == [(13.27, [16, 64])]
    assert marks_by_time({16: 10.1, 64: 13.4}) == [(10.1, [16]), (13.4, [64])]
    assert marks_by_time({16: 5.0, 64: None}) == [(5.0, [16])]


def test_timeline_png_marks_the_anchor_and_the_residual(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    runs = [_regime_run(_results()), DemoRun("loopback", None, KV_BYTES, _cfg(None), _results())]
    plot_timeline(runs, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_labels():
    names = "mooncake,lynx,lynx-int8,lynx-nospec,lynx-int8-nospec,int4-anchor"
    assert [label(v) for v in select_variants(names)] == [
        "SGLang mooncake_tcp", "Lynx exact", "Lynx int8 (lossy)", "Lynx exact, no speculation",
        "Lynx int8, no speculation (lossy)",
        "Lynx, Anchor only (lossy)"]


def _args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_the_default_demo_is_fair_and_shaped_for_r_4(monkeypatch):
    args = _args()
    variants = demo._variants(args)
    # The baseline first, without SGLang's idle spin; every variant with slow-link allowances.
    assert [v.name for v in variants] == ["mooncake-nospin", "lynx", "lynx-int8"]
    assert (IDLE_WAIT_ENV, "1") in variants[0].env
    assert all(dict(v.env).get(HEARTBEAT_ENV) for v in variants)
    monkeypatch.setattr(demo, "netns_available", lambda: None)
    assert demo._plan(args)[:2] == ((4.0,), None)
    assert demo._plan(_args(link="1gbit"))[:2] == ((), "1gbit")
    assert demo._plan(_args(link="none"))[:2] == ((), None)
    with pytest.raises(demo.DemoError, match="leave out --link"):
        demo._plan(_args(link="1gbit", regime=(4.0,)))
    monkeypatch.setattr(demo, "netns_available", lambda: "needs root")
    rs, link, line = demo._plan(args)
    assert (rs, link) == ((), None) and "loopback: no shaped link (needs root)" in line
    with pytest.raises(demo.DemoError, match="needs a shaped link"):
        demo._plan(_args(regime=(0.06,)))
    with pytest.raises(demo.DemoError, match="two variants or more"):
        demo._variants(_args(variants="lynx"))
    with pytest.raises(demo.DemoError):
        demo._variants(_args(variants="mooncake_tcp,lynx"))


def test_kv_shape_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "hidden_size": 576}))
    per_value = 1500 * 30 * 2 * 3 * 64
    assert model_kv_shape(tmp_path).bytes_for(1500) == per_value * 2  # BF16 by default
    assert model_kv_shape(tmp_path, "float32").bytes_for(1500) == per_value * 4
    assert kv_dtype_server_args("bfloat16") == ("--kv-cache-dtype", "bfloat16")
    assert kv_dtype_server_args("float32") == ()
    with pytest.raises(ValueError, match="KV dtype"):
        kv_dtype_server_args("fp8")


def test_prompt_has_exact_length():
    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    ids = passkey_prompt(Chars(), 700)
    assert len(ids) == 700
    assert "".join(map(chr, ids)).endswith("Answer:")
    assert passkey_prompt(Chars(), 700) == ids


def test_a_box_short_of_memory_is_warned_before_the_clusters_start(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8388608 kB\n")
    warning = demo.memory_warning(3, meminfo)
    assert "8.0 GiB of memory available, 3 clusters up at once need about 15 GiB" in warning
    assert demo.memory_warning(1, meminfo) is None
    assert demo.memory_warning(3, tmp_path / "missing") is None
