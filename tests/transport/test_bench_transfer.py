"""`lynx-sglang bench-transfer`: byte sizing from the codec and one small end-to-end run."""

from __future__ import annotations

import json

import pytest

from lynx_tools.bench import transfer as bt


@pytest.mark.timeout(60)
def test_sizes_follow_the_codec_accounting():
    s = bt.sizes("SmolLM2-135M", 2048)
    assert s["bf16"] == 23040 * 2048
    assert s["int8"] == 12240 * 2048
    # 4-bit Anchor + 4-bit Residual of INT8 codes: the Anchor is the INT4 baseline's size
    assert s["anchor"] == s["int4"] == 6480 * 2048
    assert s["residual"] == 5760 * 2048
    llama = bt.sizes("Llama-3.1-8B", 1000)
    assert llama["bf16"] == 131072 * 1000
    assert llama["anchor"] == 36864 * 1000
    with pytest.raises(ValueError, match="unknown model shape"):
        bt.sizes("GPT-5", 10)


@pytest.mark.timeout(120)
def test_throttled_run_reports_ratios(tmp_path, capsys):
    out = tmp_path / "bt.json"
    args = bt.argparse.Namespace(model="SmolLM2-135M", context=64, rate="200mbit",
                                 link="throttle", anchor_bits=4, target="int8", group_size=64,
                                 sink_tokens=0, recent_tokens=0, repeat=1, json_out=str(out))
    assert bt.run(args) == 0
    res = json.loads(out.read_text())
    assert res["link"] == "throttle"
    assert set(res["ratios"]) == {f"{a}/{b}" for a in ("time_to_anchor", "time_to_residual")
                                  for b in ("bf16", "int8", "int4")}
    assert all(v > 0 for v in res["ratios"].values())
    assert "time-to-Anchor" in capsys.readouterr().out
