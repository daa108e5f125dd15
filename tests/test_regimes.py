"""`bench-ttft --regime` without servers: the link rate for an R (`tools.ttft.regime`), the
deployment table's R from its stated FLOPs and bytes (`tools.regimes`) and that
docs/benchmarks.md shows the same table, the options, and the report's text and JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from lynx_tools import regimes
from lynx_tools.regimes import H100_BF16_FLOPS, PREFILL_MFU, Deployment, Model, nearest
from lynx_tools.ttft.bench import add_arguments, check_arguments
from lynx_tools.ttft.regime import (
    MAX_RATE_BPS,
    MIN_RATE_BPS,
    REGIME_VARIANTS,
    Calibration,
    Regime,
    format_regime,
    format_report,
    link_rate_for,
    parse_regimes,
    regime_json,
    slow_link_variant,
)
from lynx_tools.ttft.results import LYNX_CLIENT, BenchConfig, RequestTiming, VariantResult
from lynx_tools.variants import select_variants

ROOT = Path(__file__).resolve().parents[1]
SMOL_KV_1500 = 1500 * 30 * 2 * 3 * 64 * 2  # tokens × layers × K,V × KV heads × head dim × BF16


def test_rate_puts_the_bf16_wire_time_at_r_times_the_forward():
    rate = link_rate_for(2.0, SMOL_KV_1500, 4.0)
    assert rate.wanted_bps == pytest.approx(SMOL_KV_1500 * 8 / 8.0)
    assert rate.bps % 1000 == 0 and abs(rate.bps - rate.wanted_bps) <= 500
    assert rate.tc == f"{rate.bps // 1000}kbit" and not rate.clamped
    # The wire time at the chosen rate is R × forward within tc's 1 kbit step.
    assert SMOL_KV_1500 * 8 / rate.bps == pytest.approx(8.0, rel=1e-4)
    assert "Mbit/s" in rate.describe() and "clamped" not in rate.describe()


def test_rate_is_clamped_to_what_tc_shapes():
    slow = link_rate_for(1000.0, SMOL_KV_1500, 4.0)  # would be ~69 kbit/s
    fast = link_rate_for(1e-4, SMOL_KV_1500, 4.0)  # would be ~690 Gbit/s
    assert (slow.bps, slow.clamped) == (MIN_RATE_BPS, True)
    assert (fast.bps, fast.clamped) == (MAX_RATE_BPS, True)
    assert "clamped: R 1000 wanted" in slow.describe()
    with pytest.raises(ValueError):
        link_rate_for(0.0, SMOL_KV_1500, 4.0)


def test_parse_regimes():
    assert parse_regimes("0.3, 2,8") == (0.3, 2.0, 8.0)
    for bad in ("", "x", "2,0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_regimes(bad)


def test_deployment_r_from_stated_flops_and_bytes():
    llama8b = next(m for m in regimes.MODELS if m.name == "Llama-3.1-8B")
    d = Deployment(llama8b, 1500, 1)
    kv = 1500 * 32 * 2 * 8 * 128 * 2
    flops = 2 * 8.03e9 * 1500 + 2 * 32 * 1500 ** 2 * 32 * 128
    assert llama8b.kv_bytes(1500) == kv == 196_608_000
    assert d.forward_s == pytest.approx(flops / (H100_BF16_FLOPS * PREFILL_MFU))
    assert d.wire_s == pytest.approx(kv * 8 / 1e9)
    assert d.r == pytest.approx(d.wire_s / d.forward_s)
    # The README's rough figure (0.1 s forward, R ≈ 16 at 1 Gbit/s) is this at ~25 % MFU.
    assert Deployment(llama8b, 1500, 1, mfu=0.25).r == pytest.approx(15.6, rel=0.02)
    # R falls with the link rate exactly, and tensor parallelism divides the forward.
    assert Deployment(llama8b, 1500, 10).r == pytest.approx(d.r / 10)
    two = Model("x", 8.03e9, 32, 32, 8, 128, gpus=2)
    assert Deployment(two, 1500, 1).forward_s == pytest.approx(d.forward_s / 2)
    assert "(estimate)" in d.label() and "1.5k tokens" in d.label()


def test_nearest_deployments_on_a_log_scale():
    for r in (0.05, 0.3, 1.0, 2.0, 6.0, 20.0):
        got = nearest(r)
        assert len(got) == 3
        dist = [abs(math.log(d.r / r)) for d in got]
        assert dist == sorted(dist)
        assert all(abs(math.log(d.r / r)) >= dist[-1] for d in regimes.DEPLOYMENTS
                   if d not in got)
    with pytest.raises(ValueError):
        nearest(0)


def test_docs_show_the_deployment_table():
    assert regimes.markdown_table() in (ROOT / "docs" / "benchmarks.md").read_text()


def test_mooncake_waits_as_long_as_the_request_on_a_slow_link():
    mooncake, lynx = select_variants("mooncake-nospin,lynx")
    heartbeat = {"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "6"}
    slow = slow_link_variant(mooncake, 300.0)
    assert dict(slow.env) == {**dict(mooncake.env), "MC_TRANSFER_TIMEOUT": "300", **heartbeat}
    # Both backends' decodes tolerate the same heartbeat misses behind the KV on the slow link.
    assert dict(slow_link_variant(lynx, 300.0).env) == {**dict(lynx.env), **heartbeat}


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    return args


def test_regime_implies_interleave_and_its_defaults():
    args = _args(["--regime", "0.5,2"])
    assert args.regime == (0.5, 2.0)
    assert args.interleave and not args.use_bench_serving
    assert args.variants == REGIME_VARIANTS and args.baseline == "mooncake-nospin"
    args = _args(["--regime", "2", "--variants", "lynx,lynx-int8"])
    assert args.baseline == "lynx"


@pytest.mark.parametrize("argv, message", [
    (["--regime", "2", "--link", "10mbit"], "--regime shapes the link itself"),
    (["--regime", "2", "--url", "http://x"], "--regime: only for the clusters"),
    (["--regime", "0"], "every R must be a positive number"),
    (["--regime", "2", "--variants", "lynx"], "--interleave needs two variants or more"),
])
def test_regime_refusals(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def _request(i: int, ttft: float, done: float) -> RequestTiming:
    return RequestTiming(LYNX_CLIENT, i, 1500, 64, ttft, {16: ttft + 1.0, 64: ttft + 5.0},
                         prefill_done_s=done, network_ttft_s=round(ttft - done, 6),
                         text="same")


def _regime() -> Regime:
    base, lynx = select_variants("mooncake-nospin,lynx")
    rate = link_rate_for(2.0, SMOL_KV_1500, 4.0)
    cfg = BenchConfig(rate.tc, "/m", 1500, 64, 2, 42, (16, 64), (base.name, lynx.name),
                      base.name, 300.0, 300.0, use_bench_serving=False, interleave=True)
    results = [
        VariantResult(base, [_request(0, 13.0, 4.0), _request(1, 15.0, 6.0)],
                      {"kv": SMOL_KV_1500}, False, None, "/runs/a"),
        VariantResult(lynx, [_request(0, 6.0, 4.5), _request(1, 7.0, 5.5)],
                      {"anchor": 1_000_000, "residual": 2_000_000}, True, None, "/runs/b"),
    ]
    return Regime(rate, Calibration(base.name, ("rid-0", "rid-1"), (9.0, 4.0)), SMOL_KV_1500, cfg,
                  results)


def test_regime_achieved_r_and_report():
    g = _regime()
    assert g.measured_forward_s == pytest.approx(5.0)  # the baseline's requests only
    assert g.r_achieved == pytest.approx(8.0 / 5.0, rel=1e-3)
    text = format_regime(g)
    assert text.startswith(f"R 2: link {g.rate.describe()}")
    assert "vs forward 4.00 s (calibration)" in text  # the fastest calibration request
    assert "achieved R 1.60 (forward 5.00 s in this R's mooncake-nospin requests)" in text
    assert "stands for (estimates" in text and "Gbit/s: R ≈" in text
    assert "TTFT from send" in text and "token 64 from send" in text
    # Headline medians with their spread; bytes with their wire time at this rate.
    assert "14.00 s (13.00-15.00)" in text and "6.50 s (6.00-7.00)" in text
    assert "2.86 MiB" in text
    assert "mooncake-nospin ÷ lynx, TTFT from send: 2.15" in text
    assert format_report([g]).startswith("1500-token prompts (BF16 KV 33.0 MiB")


def test_regime_json_record():
    g = _regime()
    doc = json.loads(json.dumps(regime_json(g, "link", {"complete": True})))
    assert doc["r_target"] == 2.0 and doc["rate"]["tc"] == g.rate.tc
    assert doc["calibration"] == {"variant": "mooncake-nospin", "rids": ["rid-0", "rid-1"],
                                  "samples_s": [9.0, 4.0], "forward_s": 4.0}
    assert doc["measured_forward_s"] == 5.0 and doc["r_achieved"] == pytest.approx(1.6, rel=1e-3)
    assert doc["variant_wire"]["lynx"] == {"bytes": 3_000_000, "bytes_measured": True,
                                           "wire_s_at_rate": pytest.approx(24e6 / g.rate.bps)}
    assert len(doc["deployments"]) == 3 and all("r_estimate" in d for d in doc["deployments"])
    assert set(doc["bench"]["variants"]) == {"mooncake-nospin", "lynx"}
    assert doc["bench"]["ratios"]["mooncake-nospin/lynx"][f"{LYNX_CLIENT}.ttft_s"] == 2.1538


class _Link:
    def __init__(self):
        self.rates: list[str] = []

    def set_rate(self, rate: str, qdisc: str) -> None:
        self.rates.append(rate)


def test_run_regimes_reshapes_the_live_links_per_r(monkeypatch, tmp_path, capsys):
    """The run's glue with the clusters, the client and the trace records faked: per R, the links
    go to the calibration rate, then to R's rate, where each Lynx variant gets one unmeasured
    request (its prefill measures the link it streams by); each R reports its own requests."""
    from types import SimpleNamespace

    from lynx_tools.ttft import regime_run as run
    from lynx_tools.ttft.clusters import Measured

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "hidden_size": 576}))
    links: dict[str, _Link] = {}
    sent: list[str] = []

    def start_clusters(stack, variants, cfg, warmup_ids, out, progress):
        assert cfg.link == run.CALIBRATION_LINK
        assert dict(variants[0].env)["MC_TRANSFER_TIMEOUT"] == "300"
        return {v.name: (Measured(v, tmp_path / v.name, 1),
                         SimpleNamespace(url="u", prefill_url="p",
                                         link=links.setdefault(v.name, _Link()),
                                         spec=SimpleNamespace(link_qdisc="prio")))
                for v in variants}

    def variant_result(m, cfg, kv_shape):
        ttft = 14.0 if m.variant.transfer_backend.startswith("mooncake") else 7.0
        return VariantResult(m.variant, [_request(0, ttft, 4.0)], {"kv": SMOL_KV_1500}, False,
                             None, str(m.run_dir))

    monkeypatch.setattr(run, "start_clusters", start_clusters)
    rounds: list[tuple[str, str]] = []

    def stream_round(url, flush, name, round_, first, cfg):
        rounds.append((name, cfg.link))
        return [SimpleNamespace(t_send=100.0 + first)], [f"{name}-{first}"]

    monkeypatch.setattr(run, "stream_round", stream_round)
    monkeypatch.setattr(run, "_timeline_record",
                        lambda trace_dir, rid: {"marks": {"prefill_done": 104.0 + len(sent)}})
    monkeypatch.setattr(run, "send_interleaved",
                        lambda up, prompts, cfg, progress: sent.append(cfg.link))
    monkeypatch.setattr(run, "read_traces", lambda m: None)
    monkeypatch.setattr(run, "variant_result", variant_result)
    variants = select_variants("mooncake-nospin,lynx")
    cfg = BenchConfig("1gbit", str(tmp_path / "model"), 1500, 64, 1, 42, (16, 64),
                      tuple(v.name for v in variants), variants[0].name, 300.0, 300.0,
                      use_bench_serving=False, interleave=True)
    assert run.run_regimes((2.0, 0.5), variants, cfg, prompts=[[1]], warmup_ids=[1],
                           model_dir=tmp_path / "model", kv_shape=None, out=tmp_path) == 0
    # Calibration: prefill_done 104 + R's index, sends at 100 and 101: the faster is 3 s, then 4.
    rates = [link_rate_for(2.0, SMOL_KV_1500, 3.0).tc, link_rate_for(0.5, SMOL_KV_1500, 4.0).tc]
    assert sent == rates
    assert [r for r in rounds if "settle" in r[0]] == [("lynx-settle", rates[0]),
                                                        ("lynx-settle", rates[1])]
    for link in links.values():
        assert link.rates == ["1gbit", rates[0], "1gbit", rates[1]]
    doc = json.loads((tmp_path / "bench_ttft_regimes.json").read_text())
    assert doc["complete"] and [g["r_target"] for g in doc["regimes"]] == [2.0, 0.5]
    assert doc["regimes"][0]["calibration"]["samples_s"] == [4.0, 3.0]
    assert (tmp_path / "bench_ttft_R2.png").is_file() and (tmp_path / "bench_ttft_R0.5.png").is_file()
    assert "mooncake-nospin ÷ lynx, TTFT from send: 2.00" in capsys.readouterr().out


def test_regime_report_names_failed_requests():
    g = _regime()
    g.results[1] = dataclasses.replace(g.results[1], failed=(
        {"prompt": 3, "rid": "r3", "error": "request aborted: Lost connection"},))
    assert ("lynx: 1 request(s) failed, left out: prompt 3: request aborted: Lost connection"
            in format_regime(g))
    doc = regime_json(g, "link", {})
    assert doc["bench"]["variants"]["lynx"]["failed"][0]["prompt"] == 3
