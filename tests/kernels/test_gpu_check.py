"""scripts/gpu_check.sh's CPU rehearsal end to end (LYNX_GPU_CHECK_DEVICE=cpu): the same steps as on
a CUDA machine, Triton interpreted on small shapes, so that a bug in the script shows here and not
on the few device minutes it gets. About 1-2 min on this box (`slow`, which CI runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["install", "environment", "bit_identity", "throughput", "exact_sections",
          "layer_streamed", "compiled_kernels", "kernel_tests"]


@pytest.mark.slow
def test_cpu_rehearsal_passes_every_check(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "LYNX_GPU_CHECK_DEVICE": "cpu",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert report["ok"] and report["complete"] and report["rehearsal"]
    assert list(report["checks"]) == CHECKS
    assert all(check["ok"] for check in report["checks"].values())
    assert report["triton_interpret"] and report["torch"] and report["triton"]
    assert set(report["skipped"]) == {"install", "nvidia-smi"}

    cases = report["checks"]["bit_identity"]["all_cases"]
    assert {(c["target"], c["kind"]) for c in cases} == {(t, k) for t in ("int8", "exact") for k in "kv"}
    ratios = report["checks"]["throughput"]["ratio_to_copy"]
    assert set(ratios) == {f"{api}/triton/{target}/{kind}" for api in ("tensors", "fused")
                           for target in ("int8", "exact") for kind in "kv"}
    sections = report["checks"]["exact_sections"]
    assert sections["sections_equal_reference"] and sections["values_decoded_back"]
    assert sections["chunks"] >= 2 and sections["encode_ratio_to_copy"] > 0
    streamed = report["checks"]["layer_streamed"]
    assert "HostEvent" in streamed["events"]
    for target in ("int8", "exact"):
        assert streamed["targets"][target]["bytes_equal"]
        assert 0 <= streamed["targets"][target]["hidden_fraction"] <= 1
    compiled = report["checks"]["compiled_kernels"]
    assert compiled["kernels"] and compiled["launched_here"] == 0  # interpreted: no cubins
    assert report["checks"]["kernel_tests"]["tests"] > 0
    for name in ("bench_codec_cpu_tensors.json", "bench_codec_cpu_fused.json",
                 "kernels-junit.xml", "kernels-tests.log"):
        assert (tmp_path / name).is_file(), name
