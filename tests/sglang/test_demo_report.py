"""The demo's report on canned results: table columns, identical-output verdict, computed
mooncake bytes, prompt construction, the PNG, and the prefill timeline log parser."""

from __future__ import annotations

import json

import pytest

from lynx_sglang.demo import BackendResult, KVShape, build_prompt, format_table, plot_timeline
from lynx_sglang.timeline import prefill_done_events


def _result(backend: str, ids: list[int], **kw) -> BackendResult:
    base = dict(backend=backend, prompt_tokens=1500, output_ids=ids, prefill_done_s=0.8,
                first_token_s=1.1, last_token_s=1.9, stream_bytes={"kv": 1 << 20},
                bytes_measured=False, lynx_events_s={}, run_dir="/tmp/x")
    base.update(kw)
    return BackendResult(**base)


LYNX = dict(stream_bytes={"anchor": 3 << 20, "residual": 5 << 20}, bytes_measured=True,
            first_token_s=2.0, lynx_events_s={"anchor_landed": 1.2, "anchor_applied": None,
                                              "residual_landed": 1.5, "residual_applied": 1.9})


def test_table_reports_each_backend_and_verdict():
    same = format_table([_result("lynx", [1, 2], **LYNX), _result("mooncake_tcp", [1, 2])],
                        "loopback")
    assert "outputs identical across backends: yes" in same
    assert "Anchor 3.00 MiB / Residual 5.00 MiB" in same
    assert "KV 1.00 MiB (computed)" in same
    lynx_row = next(ln for ln in same.splitlines() if ln.startswith("lynx "))
    assert "2000 ms" in lynx_row and "1200 ms" in lynx_row  # TTFT, first token - prefill done
    differ = format_table([_result("lynx", [1, 2], **LYNX), _result("mooncake_tcp", [1, 3])],
                          "loopback")
    assert "outputs identical across backends: NO" in differ


def test_kv_shape_bytes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
         "hidden_size": 576}))
    assert KVShape.from_model_dir(tmp_path).bytes_for(1500) == 1500 * 30 * 2 * 3 * 64 * 4


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    plot_timeline([_result("lynx", [1], **LYNX), _result("mooncake_tcp", [1])], path, "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_has_exact_length():
    class Chars:  # one token per character
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    ids = build_prompt(Chars(), 700)
    assert len(ids) == 700
    assert "".join(map(chr, ids)).endswith("Answer:")
    assert build_prompt(Chars(), 700) == ids


def test_prefill_done_events_parses_log_lines():
    log = ("[2026] INFO noise\n"
           '[2026] lynx_sglang.timeline INFO lynx timeline {"rid": "a", "event": "prefill_done",'
           ' "tokens": 5, "t": 1.5}\n')
    assert prefill_done_events(log) == [{"rid": "a", "event": "prefill_done", "tokens": 5,
                                         "t": 1.5}]


def test_transfer_line_skips_the_startup_line():
    from lynx_sglang.demo import _last_transfer_line

    log = ("[t] lynx transfer backend selected: LynxConfig(...)\n"
           '[t] lynx transfer {"room": 1, "tokens": 9}\n'
           "[t] lynx transfer backend selected: LynxConfig(...)\n")
    assert _last_transfer_line(log) == {"room": 1, "tokens": 9}


def test_single_backend_has_no_verdict():
    table = format_table([_result("lynx", [1, 2], **LYNX)], "loopback")
    assert "outputs identical across backends: n/a (one backend)" in table
