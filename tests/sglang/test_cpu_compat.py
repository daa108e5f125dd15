"""lynx_sglang.upstream.cpu_compat in fresh interpreters: the fallbacks exist only with the CPU engine
selected and no CUDA device, and only for packages that are not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import sys
from lynx_sglang.upstream import cpu_compat
print("active", cpu_compat.activate())
try:
    import sgl_kernel
except ModuleNotFoundError:
    print("sgl_kernel missing")
    sys.exit(0)
import torch
rt = torch.zeros(2, 8, dtype=torch.int32)
sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([1]), rt, torch.tensor([2]),
                                        torch.tensor([5]), torch.tensor([7, 8, 9]), 8)
print("assigned", rt[1].tolist())
try:
    sgl_kernel.some_cuda_op(1)
except NotImplementedError as exc:
    print("op refused", "some_cuda_op" in str(exc))
from sgl_kernel.mamba import anything
from torchvision.transforms import InterpolationMode
import torchvision.transforms as T
print("torchvision", InterpolationMode.BICUBIC.value, callable(T.Resize))
import json
print("json real", hasattr(json, "dumps"))
"""


def _run(cpu_engine: bool) -> str:
    env = dict(os.environ)
    env.pop("SGLANG_USE_CPU_ENGINE", None)
    if cpu_engine:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_fallbacks_with_cpu_engine():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the fallbacks must stay off (checked below)")
    out = _run(cpu_engine=True)
    assert "active True" in out
    assert "assigned [0, 0, 7, 8, 9, 0, 0, 0]" in out
    assert "op refused True" in out
    assert "torchvision bicubic True" in out
    assert "json real True" in out


def test_no_fallbacks_without_cpu_engine():
    out = _run(cpu_engine=False)
    assert "active False" in out
    assert "sgl_kernel missing" in out


def test_prefill_module_sees_always_complete_cuda_events():
    """The guard of `disaggregation.prefill` (its overlap path records a CUDA event before the
    early send of a cached prefix): that module's torch.cuda.Event is torch.cpu.Event, every
    other torch name is the real one, and torch itself is untouched."""
    import types

    import torch

    from lynx_sglang.upstream import cpu_compat

    module = types.ModuleType("prefill_probe")
    module.torch = torch
    cpu_compat._cpu_events_in_prefill(module)
    event = module.torch.cuda.Event()
    event.record(module.torch.cpu.Stream())
    event.synchronize()
    assert event.query()
    assert module.torch.zeros is torch.zeros
    assert module.torch.cuda.is_available is torch.cuda.is_available
    assert torch.cuda.Event is not torch.cpu.Event
