"""The demo's report on canned results: table columns (token 16/64 times, speculation counts),
network-exposed TTFT ratios, the identical-output verdict among exact variants only, the lossy
variant's token match, computed mooncake bytes, prompt construction, the `lynx spec` / transfer
log parsers, the verification time estimate and the PNG."""

from __future__ import annotations

import json

import pytest

from lynx_tools.demo import (
    DemoError,
    DemoResult,
    SpecOutcome,
    format_table,
    layer_streams,
    network_ttft_ratios,
    plot_timeline,
    regime_note,
    select_variants,
    token_match,
)
from lynx_tools.measure import (
    kv_dtype_server_args,
    model_kv_shape,
    spec_lines,
)
from lynx_tools.prompts import passkey_prompt


def _result(variant: str, ids: list[int], **kw) -> DemoResult:
    base = dict(variant=variant, exact=variant != "int4-anchor", prompt_tokens=1500,
                output_ids=ids, prefill_done_s=0.8, first_token_s=1.1, last_token_s=1.9,
                token_s={16: 1.3, 64: 1.8}, stream_bytes={"kv": 1 << 20}, bytes_measured=False)
    base.update(kw)
    return DemoResult(**base)


LYNX = dict(stream_bytes={"anchor": 3 << 20, "residual": 5 << 20}, bytes_measured=True,
            first_token_s=1.0, token_s={16: 1.6, 64: 2.4},
            lynx_events_s={"anchor_landed": 0.85, "anchor_applied": 0.9,
                           "residual_landed": 1.2, "residual_applied": 1.25},
            spec=SpecOutcome(10, 7, 3, 40.0), verified_s=1.45)
NOSPEC = dict(LYNX, first_token_s=1.3, spec=None, verified_s=None)
INT4 = dict(stream_bytes={"anchor": 3 << 20, "residual": 0}, bytes_measured=True,
            first_token_s=0.9, token_s={16: 1.2, 64: None})


def _row(table: str, name: str) -> str:
    return next(ln for ln in table.splitlines() if ln.startswith(name + " "))


def test_table_reports_each_variant_and_verdict():
    table = format_table([_result("mooncake", [1, 2, 3]), _result("lynx-nospec", [1, 2, 3], **NOSPEC),
                          _result("lynx", [1, 2, 3], **LYNX), _result("int4-anchor", [1, 9, 3], **INT4)],
                         "loopback")
    assert "outputs identical across exact variants (mooncake, lynx-nospec, lynx): yes" in table
    assert "int4-anchor: lossy, not compared; vs the exact output: first 1, 2 of 3 positions" in table
    lynx = _row(table, "lynx")
    # TTFT, net TTFT (first token - prefill done), token 16 / 64 from send and from prefill done.
    for cell in ("1000 ms", "200 ms", "1600 (800) ms", "2400 (1600) ms",
                 "Anchor 3.00 MiB / Residual 5.00 MiB", "10/7/3"):
        assert cell in lynx
    assert "KV 1.00 MiB (computed)" in _row(table, "mooncake")
    int4 = _row(table, "int4-anchor")
    assert "Anchor 3.00 MiB / no Residual" in int4 and "- (-) ms" in int4  # no token 64
    assert "net TTFT mooncake ÷ lynx: 1.50" in table
    assert "net TTFT lynx-nospec ÷ lynx: 2.50" in table
    assert "net TTFT lynx ÷ int4-anchor: 2.00" in table


def test_lossy_variant_does_not_break_the_verdict_but_exact_ones_do():
    lossy_differs = format_table([_result("mooncake", [1, 2]), _result("lynx", [1, 2], **LYNX),
                                  _result("int4-anchor", [5, 6], **INT4)], "loopback")
    assert "exact variants (mooncake, lynx): yes" in lossy_differs
    exact_differs = format_table([_result("mooncake", [1, 2]), _result("lynx", [1, 3], **LYNX)],
                                 "loopback")
    assert "exact variants (mooncake, lynx): NO" in exact_differs
    single = format_table([_result("lynx", [1, 2], **LYNX)], "loopback")
    assert ": n/a (fewer than two exact variants)" in single


def test_ratios_only_for_pairs_that_ran():
    assert network_ttft_ratios([_result("mooncake", [1]), _result("int4-anchor", [1], **INT4)]) == {}
    assert network_ttft_ratios([_result("mooncake", [1]), _result("lynx", [1], **LYNX)]) == {
        "mooncake/lynx": 1.5}


def test_token_match():
    assert token_match([1, 2, 3, 4], [1, 2, 9, 4]) == (2, 3)
    assert token_match([7], [1, 2]) == (0, 0)


def test_variants_by_name():
    assert [v.name for v in select_variants("mooncake, lynx")] == ["mooncake", "lynx"]
    # SGLang's default scheduler unless a variant is named without it.
    assert [(v.name, v.overlap_schedule) for v in select_variants("lynx,lynx@no-overlap")] == [
        ("lynx", True), ("lynx@no-overlap", False)]

    with pytest.raises(DemoError):
        select_variants("mooncake_tcp")


def test_spec_lines_parse_only_json_records():
    log = ('[t] lynx spec: abc parked: cap\n'
           '[t] lynx spec {"room": 4, "speculated": 10, "accepted": 10, "rolled_back": 0}\n')
    (line,) = spec_lines(log)
    assert line["room"] == 4 and line["accepted"] == 10


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


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    plot_timeline([_result("mooncake", [1]), _result("lynx", [1], **LYNX),
                   _result("int4-anchor", [1], **INT4)], path, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_has_exact_length():
    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    ids = passkey_prompt(Chars(), 700)
    assert len(ids) == 700
    assert "".join(map(chr, ids)).endswith("Answer:")
    assert passkey_prompt(Chars(), 700) == ids


def test_the_regime_note_says_which_part_was_slow():
    """8 MiB of Lynx streams: 67 ms at 1 Gbit/s, hidden by a 0.8 s forward; 6.7 s at 10 Mbit/s,
    longer than the forward."""
    results = [_result("mooncake", [1]), _result("lynx", [1], **LYNX)]
    fast = regime_note(results, 1e9)
    assert "forward took 0.8 s" in fast and "67 ms of wire" in fast
    # mooncake's 1 MiB of KV: 8.4 ms of wire over a 0.8 s forward, and the GPU setups near it.
    assert fast.startswith("R (the whole KV's wire time / the forward) = 0.01; on H100s that is "
                           "about "), fast
    assert fast.count("(estimate)") == 2
    assert "layer streaming sent them while the forward ran" in fast
    slow = regime_note(results, 1e7)
    assert "6711 ms of wire" in slow and "the link is the slow part" in slow
    assert regime_note(results, None) is None  # loopback: no rate to weigh
    assert regime_note([_result("mooncake", [1])], 1e9) is None
    # With --no-lynx-layer-stream the prefill sends after its forward.
    after = regime_note([_result("mooncake", [1]), _result("lynx", [1], **LYNX,
                                                           layer_stream=False)], 1e9)
    assert "sent them after the forward" in after and "layer streaming sent" not in after


def test_a_lynx_prefill_streams_layers_under_either_scheduler_unless_told_not_to():
    lynx, off, after, moon = select_variants(
        "lynx,lynx@no-overlap,lynx-after-forward,mooncake")
    assert [layer_streams(v) for v in (lynx, off, after, moon)] == [True, True, False, False]
