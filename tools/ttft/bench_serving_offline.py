"""`python -m lynx_tools.ttft.bench_serving_offline [bench_serving arguments]`: SGLang's own benchmark
client, `python -m sglang.bench_serving`, run unchanged on a box set up by scripts/install.sh.

Two imports stand between that module and this box, and neither is used by the synthetic
(`--dataset-name random-ids`) benchmark `lynx_tools.ttft.bench` runs:
- HF `datasets`: SGLang 0.5.23 imports `load_dataset` at module load only for its MMMU dataset
  (sglang/benchmark/datasets/mmmu.py); the package is not installed (it is not needed to serve).
  Where it is missing, a stub module whose `load_dataset` raises stands in for it.
- `torchvision` (via sglang.srt.configs): without CUDA it gets the same import fallback the
  servers get (`lynx_sglang.upstream.cpu_compat`, activated as in `lynx_sglang.serve`).
With `datasets` installed and a CUDA device present this is exactly `python -m sglang.bench_serving`.
Called by `lynx_tools.ttft.bench` as a subprocess.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import types

from lynx_sglang.upstream import cpu_compat


def _load_dataset(*args, **kwargs):
    raise RuntimeError("the HF `datasets` package is not installed; lynx_tools.ttft.bench_serving_offline "
                       "only supports datasets that do not need it (e.g. --dataset-name random-ids)")


def main() -> None:
    if not os.environ.get(cpu_compat.CPU_ENGINE_ENV) and not cpu_compat.cuda_device_present():
        os.environ[cpu_compat.CPU_ENGINE_ENV] = "1"
    cpu_compat.activate()
    if importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.load_dataset = _load_dataset
        sys.modules["datasets"] = stub
    runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
