"""The TTFT benchmark's pure parts on canned data (no servers): bench_serving result parsing and
token times from its ITLs, matching the prefill/decode log lines to client requests, medians,
baseline ratios, the JSON layout, the variant table and the PNG."""

from __future__ import annotations

import itertools
import json

import pytest

from lynx_sglang.names import IDLE_WAIT_ENV, TRACE_DIR_ENV
from lynx_tools.client import StreamedGeneration
from lynx_tools.cluster.spec import server_command
from lynx_tools.measure import transfer_lines
from lynx_tools.prompts import random_ids_prompts
from lynx_tools.ttft.bench import cluster_spec, interleaved_order, lynx_stream_bytes
from lynx_tools.ttft.clients import bench_serving_command
from lynx_tools.ttft.report import format_table, plot, result_json
from lynx_tools.ttft.results import (
    BENCH_SERVING,
    LYNX_CLIENT,
    BenchConfig,
    BenchError,
    RequestTiming,
    VariantResult,
    client_timing,
    medians,
    parse_bench_serving,
    ratios,
    same_text_as_baseline,
    spreads,
    token_times_from_itl,
)
from lynx_tools.variants import VariantError, scheduler_note, select_variants

MARKS = (2, 4)


def test_token_times_one_token_per_chunk():
    assert token_times_from_itl(1.0, [0.1, 0.2, 0.3], 4, (1, 2, 4, 5)) == pytest.approx(
        {1: 1.0, 2: 1.1, 4: 1.6, 5: None})


def test_token_times_first_chunk_of_two_tokens():
    # 4 tokens, 2 ITLs: the first chunk carried tokens 1 and 2.
    assert token_times_from_itl(1.0, [0.5, 0.25], 4, (2, 3, 4)) == pytest.approx(
        {2: 1.0, 3: 1.5, 4: 1.75})
    with pytest.raises(BenchError):
        token_times_from_itl(1.0, [0.1] * 4, 4, (2,))


def _bench_result(**kw) -> dict:
    base = {"input_lens": [300, 300], "output_lens": [4, 4], "ttfts": [1.0, 2.0],
            "itls": [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2]], "generated_texts": ["a", "b"],
            "errors": ["", ""]}
    return base | kw


def test_parse_bench_serving():
    got = parse_bench_serving(_bench_result(), MARKS)
    assert [r.client for r in got] == [BENCH_SERVING] * 2
    assert [r.ttft_s for r in got] == [1.0, 2.0]
    assert got[1].token_s == pytest.approx({2: 2.2, 4: 2.6})
    assert got[0].network_ttft_s is None and got[0].text == "a"
    with pytest.raises(BenchError, match="1 failed"):
        parse_bench_serving(_bench_result(errors=["", "Traceback boom"]), MARKS)


DECODE_LOG = "\n".join([
    "[t] lynx transfer backend selected: LynxConfig(...)",
    *(f'[t] lynx transfer {{"room": {i}, "tokens": 300, "anchor_bytes": 10, "residual_bytes": 30,'
      f' "announced": {t}, "anchor_landed": {t + 0.2}, "anchor_applied": null, '
      f'"residual_landed": {t + 0.4}, "residual_applied": {t + 0.5}}}'
      for i, t in ((1, 100.1), (2, 110.1))),
])


def test_transfer_log_records_skip_the_start_up_line():
    assert [ln["room"] for ln in transfer_lines(DECODE_LOG)] == [1, 2]


def _streamed(t_send: float) -> StreamedGeneration:
    return StreamedGeneration([5, 6, 7, 8], 300, t_send, t_send + 1.0, t_send + 1.3,
                              (t_send + 1.0, t_send + 1.1, t_send + 1.2, t_send + 1.3), "txt")


def test_client_timing_from_the_requests_records():
    g = _streamed(110.0)
    transfer = {"anchor_bytes": 10, "residual_bytes": 30, "anchor_landed": 110.3,
                "residual_applied": 110.6}
    t = client_timing(1, g, MARKS, 110.5, transfer)
    assert t.client == LYNX_CLIENT and t.output_tokens == 4
    assert t.ttft_s == pytest.approx(1.0) and t.prefill_done_s == pytest.approx(0.5)
    assert t.network_ttft_s == pytest.approx(0.5)
    assert t.token_s == pytest.approx({2: 1.1, 4: 1.3})
    assert t.stream_bytes == {"anchor": 10, "residual": 30}
    assert t.lynx_events_s["anchor_applied"] is None
    assert t.lynx_events_s["residual_applied"] == pytest.approx(0.6)


def _timing(client: str, ttft: float, net: float | None = None, t4: float | None = None):
    return RequestTiming(client, 0, 300, 4, ttft, {2: ttft + 0.1, 4: t4}, network_ttft_s=net)


def test_medians_and_ratios():
    slow = [_timing(BENCH_SERVING, t) for t in (2.0, 4.0, 3.0)] + [
        _timing(LYNX_CLIENT, 3.0, net=1.0, t4=3.5)]
    fast = [_timing(BENCH_SERVING, t) for t in (1.0, 1.5, 9.0)] + [
        _timing(LYNX_CLIENT, 2.0, net=0.25, t4=None)]
    med_slow, med_fast = medians(slow, MARKS), medians(fast, MARKS)
    assert med_slow[f"{BENCH_SERVING}.ttft_s"] == 3.0
    assert med_fast[f"{BENCH_SERVING}.ttft_s"] == 1.5
    assert f"{BENCH_SERVING}.net_ttft_s" not in med_slow  # bench_serving has no send time
    assert f"{LYNX_CLIENT}.t4_s" not in med_fast  # no value, no median
    r = ratios({"mooncake": med_slow, "lynx": med_fast}, "mooncake")
    assert list(r) == ["mooncake/lynx"]
    assert r["mooncake/lynx"][f"{BENCH_SERVING}.ttft_s"] == 2.0
    assert r["mooncake/lynx"][f"{LYNX_CLIENT}.net_ttft_s"] == 4.0
    assert f"{LYNX_CLIENT}.t4_s" not in r["mooncake/lynx"]
    assert ratios({"lynx": med_fast}, "mooncake") == {}  # baseline not measured (yet)


def test_token_times_from_prefill_done_and_time_per_token():
    def lynx(i, done, t2, t4, text="x"):
        return RequestTiming(LYNX_CLIENT, i, 300, 4, t2 - 0.1, {2: t2, 4: t4},
                             prefill_done_s=done, network_ttft_s=0.01, text=text)

    reqs = [lynx(0, 0.5, 1.1, 1.3), lynx(1, 1.0, 2.0, 2.6), lynx(2, None, 3.0, None),
            _timing(BENCH_SERVING, 1.0, t4=1.4)]
    med, spread = medians(reqs, MARKS), spreads(reqs, MARKS)
    # token 2 after prefill done: 0.6 and 1.0 (the request without a prefill line left out)
    assert med[f"{LYNX_CLIENT}.t2_from_done_s"] == pytest.approx(0.8)
    assert spread[f"{LYNX_CLIENT}.t2_from_done_s"] == pytest.approx([0.6, 1.0])
    assert spread[f"{LYNX_CLIENT}.t4_from_done_s"] == pytest.approx([0.8, 1.6])
    # per token between the 2nd and the 4th: 0.1 and 0.3; none without the 4th token
    assert spread[f"{LYNX_CLIENT}.tpot_s"] == pytest.approx([0.1, 0.3])
    assert not any(k.startswith(BENCH_SERVING) and ("from_done" in k or "tpot" in k)
                   for k in med)


def test_outputs_compared_with_the_baseline_prompt_by_prompt():
    moon, lynx, int4 = select_variants("mooncake,lynx,int4-anchor")

    def result(variant, texts):
        return VariantResult(variant, [
            RequestTiming(LYNX_CLIENT, i, 300, 4, 1.0, {}, text=t) for i, t in enumerate(texts)
        ], {}, False, None, "/tmp/x")

    results = [result(moon, ["a", "b"]), result(lynx, ["a", "b"]), result(int4, ["a", "c"])]
    assert same_text_as_baseline(results, "mooncake") == {"lynx": True, "int4-anchor": False}
    assert same_text_as_baseline(results[1:], "mooncake") == {"lynx": None, "int4-anchor": None}
    table = format_table(results, _cfg(), "1gbit link", {})
    assert ("same output text as mooncake, prompt by prompt: lynx True, int4-anchor False "
            "(lossy variant)") in table


def _cfg() -> BenchConfig:
    return BenchConfig("1gbit", "/m", 300, 4, 1, 42, MARKS, ("mooncake", "lynx"), "mooncake",
                       300.0, 300.0)


def _results() -> list[VariantResult]:
    moon, lynx = select_variants("mooncake,lynx")
    return [
        VariantResult(moon, [_timing(BENCH_SERVING, 2.0), _timing(LYNX_CLIENT, 2.0, 1.0, 2.5)],
                      {"kv": 1 << 20}, False, True, "/tmp/m"),
        VariantResult(lynx, [_timing(BENCH_SERVING, 1.0), _timing(LYNX_CLIENT, 1.0, 0.5, 1.5)],
                      {"anchor": 1 << 19, "residual": 1 << 20}, True, False, "/tmp/l"),
    ]


def test_json_table_and_plot(tmp_path):
    results, cfg = _results(), _cfg()
    table_ratios = ratios({r.variant.name: medians(r.requests, MARKS) for r in results},
                          "mooncake")
    doc = json.loads(json.dumps(result_json(results, cfg, "1gbit link", table_ratios,
                                            {"wall_s": 1.0})))
    assert doc["config"]["prompt_tokens"] == 300 and doc["config"]["wall_s"] == 1.0
    assert [v["name"] for v in doc["config"]["variant_specs"]] == ["mooncake", "lynx"]
    lynx = doc["variants"]["lynx"]
    assert lynx["medians"][f"{LYNX_CLIENT}.net_ttft_s"] == 0.5
    assert [len(lynx["requests"][c]) for c in (BENCH_SERVING, LYNX_CLIENT)] == [1, 1]
    assert lynx["warmup_attempts"] == 1 and lynx["server_config"] is None
    assert doc["ratios"]["mooncake/lynx"][f"{LYNX_CLIENT}.net_ttft_s"] == 2.0
    table = format_table(results, cfg, "1gbit link", table_ratios)
    lynx_row = next(ln for ln in table.splitlines() if ln.startswith("lynx "))
    assert "500 ms" in lynx_row and "Anchor 0.50 MiB / Residual 1.00 MiB" in lynx_row
    assert "KV 1.00 MiB (computed)" in table
    assert "'lynx': False" in table
    pytest.importorskip("matplotlib")
    plot(results, cfg, tmp_path / "b.png", "t")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_variants_by_name():
    assert [v.transfer_backend for v in select_variants("lynx-int8, mooncake")] == [
        "lynx", "mooncake_tcp"]
    assert select_variants("lynx-int8")[0].server_args == ("--lynx-target", "int8")
    with pytest.raises(VariantError, match="unknown"):
        select_variants("lynx,nope")


def test_bench_serving_command_is_offline_and_sequential(tmp_path):
    cmd = bench_serving_command("http://r", tmp_path, 300, 4, 2, 7, tmp_path / "o.jsonl")
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert cmd[1:3] == ["-m", "lynx_tools.ttft.bench_serving_offline"]
    assert flag("--dataset-name") == "random-ids" and "--tokenize-prompt" in cmd
    assert flag("--random-range-ratio") == "1" and flag("--max-concurrency") == "1"
    assert flag("--tokenizer") == str(tmp_path) and flag("--warmup-requests") == "0"
    assert flag("--request-rate") == "inf"
    cmd = bench_serving_command("http://r", tmp_path, 300, 4, 8, 7, tmp_path / "o.jsonl", 4)
    assert cmd[cmd.index("--max-concurrency") + 1] == "4"
    # bench-load's Poisson arrivals and mixed lengths
    cmd = bench_serving_command("http://r", tmp_path, 300, 4, 8, 7, tmp_path / "o.jsonl", 8,
                                request_rate=0.25, range_ratio=0.5)
    assert cmd[cmd.index("--request-rate") + 1] == "0.25"
    assert cmd[cmd.index("--random-range-ratio") + 1] == "0.5"


def test_random_ids_prompts():
    prompts = random_ids_prompts(1000, 50, 4, 3, seed=42)
    assert [len(p) for p in prompts] == [50] * 3
    assert all(b == (a + 1) % 1000 for p in prompts for a, b in itertools.pairwise(p))
    assert random_ids_prompts(1000, 50, 4, 3, seed=42) == prompts
    assert random_ids_prompts(1000, 50, 4, 3, seed=43) != prompts


def test_stream_bytes_take_the_median_residual_and_refuse_differing_anchors():
    exact = [{"anchor": 100, "residual": r} for r in (150, 151, 149, 170)]
    assert lynx_stream_bytes("lynx", exact) == {"anchor": 100, "residual": 150}
    with pytest.raises(BenchError, match="Anchor bytes differ"):
        lynx_stream_bytes("lynx", [{"anchor": 100, "residual": 1}, {"anchor": 101, "residual": 1}])


def test_interleaved_rounds_turn_which_variant_goes_first():
    order = interleaved_order(["mooncake", "lynx", "int4"], 4)
    assert order == [["mooncake", "lynx", "int4"], ["lynx", "int4", "mooncake"],
                     ["int4", "mooncake", "lynx"], ["mooncake", "lynx", "int4"]]
    # over a whole turn each variant takes each place once
    assert all(sorted(r[i] for r in order[:3]) == ["int4", "lynx", "mooncake"] for i in range(3))


def test_a_variants_environment_reaches_its_servers(tmp_path):
    cfg = _cfg()
    spec = cluster_spec(select_variants("mooncake-nospin")[0], cfg, tmp_path)
    assert spec.extra_env[IDLE_WAIT_ENV] == "1" and spec.transfer_backend == "mooncake_tcp"
    assert spec.extra_env[TRACE_DIR_ENV] == str(tmp_path / "trace")
    assert IDLE_WAIT_ENV not in cluster_spec(select_variants("mooncake")[0], cfg,
                                              tmp_path).extra_env


def test_variants_run_sglangs_default_scheduler_unless_named_no_overlap(tmp_path):
    lynx, off = select_variants("lynx,lynx@no-overlap")
    assert off.name == "lynx@no-overlap" and off.server_args == lynx.server_args
    on_spec, off_spec = (cluster_spec(v, _cfg(), tmp_path) for v in (lynx, off))
    assert on_spec.overlap_schedule and not off_spec.overlap_schedule
    assert "--disable-overlap-schedule" not in server_command(on_spec, 1, "decode", 2)
    assert "--disable-overlap-schedule" in server_command(off_spec, 1, "decode", 2)
    # The configuration line says which variant ran which scheduler.
    note = scheduler_note([lynx, off, select_variants("mooncake")[0]])
    assert "overlap scheduler for ['lynx', 'mooncake']" in note
    assert "--disable-overlap-schedule for ['lynx@no-overlap']" in note
    with pytest.raises(VariantError, match="NAME@no-overlap"):
        select_variants("lynx@overlap")


def test_the_table_shows_each_requests_speculation():
    moon, lynx = _results()
    outcome = {"speculated": 20, "accepted": 12, "rolled_back": 8}
    lynx.requests.append(RequestTiming(LYNX_CLIENT, 1, 300, 4, 1.0, {2: 1.1, 4: 1.4},
                                       speculation=outcome))
    table = format_table([moon, lynx], _cfg(), "1gbit link", {})
    assert "speculated/accepted/rolled back tokens per request (lynx client): lynx 20/12/8" in table


def test_a_failed_request_is_left_out_and_the_run_goes_on(monkeypatch):
    """An interleaved run (bench-ttft --interleave / --regime) records a request that failed and
    sends the rest: the variant keeps its other requests, with their prompt numbers, and the
    outputs are compared on the prompts both variants have."""
    from lynx_tools.client import GenerateError
    from lynx_tools.progress import Progress
    from lynx_tools.ttft import clusters as ttft_clusters

    moon, lynx = select_variants("mooncake,lynx")
    stream = StreamedGeneration([5], 300, 0.0, 1.0, 1.0, (1.0,), "t")

    def outcomes(url, flush_url, name, round_, first, cfg):
        ids = [f"{name}-{first + j}" for j in range(len(round_))]
        if name == "lynx" and first == 1:
            return [GenerateError("request aborted: Lost connection with prefill instance")], ids
        return [stream] * len(round_), ids

    monkeypatch.setattr(ttft_clusters, "stream_round_outcomes", outcomes)
    cluster = type("Cluster", (), {"url": "http://router", "prefill_url": "http://prefill"})
    up = {v.name: (ttft_clusters.Measured(v, "/tmp/x", 1), cluster) for v in (moon, lynx)}
    ttft_clusters.send_interleaved(up, [[1], [2], [3]], _cfg(), Progress("t", 2))
    m_moon, m_lynx = up["mooncake"][0], up["lynx"][0]
    assert m_moon.prompts == [0, 1, 2] and not m_moon.failed
    assert m_lynx.prompts == [0, 2] and m_lynx.rids == ["lynx-0", "lynx-2"]
    assert m_lynx.failed == [{"prompt": 1, "rid": "lynx-1",
                              "error": "request aborted: Lost connection with prefill instance"}]

    def result(variant, texts):
        return VariantResult(variant, [RequestTiming(LYNX_CLIENT, i, 300, 4, 1.0, {}, text=t)
                                       for i, t in texts.items()], {}, False, None, "/tmp/x")

    base = result(moon, {0: "a", 1: "b", 2: "c"})
    assert same_text_as_baseline([base, result(lynx, {0: "a", 2: "c"})], "mooncake") == {
        "lynx": True}
    assert same_text_as_baseline([base, result(lynx, {0: "a", 2: "x"})], "mooncake") == {
        "lynx": False}
