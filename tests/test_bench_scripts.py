"""The benchmark scripts still run against the current APIs (a tiny size, one repeat) and write the
JSON they promise; their numbers are measured by hand (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args, "--json",
                           str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_kv_path_runs_and_checks_exactness(tmp_path):
    report = _run("bench_kv_path.py", "--tokens", "70", "--repeats", "1", out=tmp_path / "kv.json")
    assert {r["target"] for r in report["rows"]} == {"exact", "int8"}
    for row in report["rows"]:
        assert row["prefill_s"] > 0 and row["decode_s"] > 0 and row["anchor_bytes"] > 0
    exact = next(r for r in report["rows"] if r["target"] == "exact")
    assert 0 < exact["residual_bytes"] < exact["kv_bytes"]


def test_bench_codec_runs(tmp_path):
    report = _run("bench_codec.py", "--tokens", "128", "--repeats", "1", "--torch-repeats", "1",
                  "--impls", "cpu", out=tmp_path / "codec.json")
    assert report


def test_exact_format_study_runs_on_real_kv(tmp_path):
    report = _run("exact_format_study.py", "--prompts", "1", "--prompt-tokens", "64",
                  out=tmp_path / "study.json")
    bits = report["bits_per_value"]
    # the entropy bound is a lower bound for every coder measured under the same class model
    assert bits["entropy"] <= bits["classrice"]
    assert set(bits) >= {"classrice", "entropy", "pfor-8", "maxwidth-8", "classwidth-4"}
    assert report["coded_values"] > 0
