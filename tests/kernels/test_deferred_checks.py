"""The serving encode's input checks read at the run's finish (`lynx_kernels.deferred_checks`):
the same errors as the immediate checks, and no read-back of the pool's or the slots' values
while a run is queued.

torch's sync debug mode (`torch.cuda.set_sync_debug_mode`) needs CUDA, so on this CPU box the
read-backs are found by following the run's values through torch's dispatcher instead
(`DeviceReads`); scripts/gpu_check.py counts the device's own waits (`serving_host_syncs`)."""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lynx_kernels import CodecError, CodecSpec, fused, wire_write

IMPLS = ["torch"]
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    IMPLS.append("triton")  # interpreted on CPU tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def start(x: torch.Tensor, slots: torch.Tensor, spec: CodecSpec, impl: str, kind: str = "v"):
    sizes = fused.run_nbytes(spec, kind, x.dtype, *x.shape[1:], len(slots), 64)
    anchor, residual = np.zeros(sizes.anchor, np.uint8), np.zeros(sizes.residual_bound, np.uint8)
    return fused.encode_run_start(x, slots, spec, kind, 2, 64, 1, anchor, residual, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("target", "value", "message"), [
    ("exact", torch.nan, "layer 2 V: NaN value nan at token 5, head 1, channel 3"),
    ("int8", torch.nan, "layer 2 V: non-finite value nan at token 5, head 1, channel 3"),
    ("int8", torch.inf, "layer 2 V: non-finite value inf at token 5, head 1, channel 3"),
    ("int8", 1e6, "beyond what fp16 scale/zero can represent"),
])
def test_refused_values_raise_from_finish_as_before(impl, target, value, message):
    x = torch.randn(30, 2, 64)
    x[5, 1, 3] = value
    spec = CodecSpec(target=target)
    slots = torch.arange(30)
    pending = start(x.to(DEVICE), slots.to(DEVICE), spec, impl)  # queued: nothing read yet
    with pytest.raises(CodecError, match=message) as deferred:
        pending.finish()
    with pytest.raises(CodecError) as immediate:  # the C codec checks at once
        start(x, slots, spec, "cpu")
    assert str(deferred.value) == str(immediate.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_slots_outside_the_pool_raise_from_finish_as_before(impl):
    x = torch.randn(30, 2, 64)
    for slots in (torch.arange(30) + 3, torch.arange(30) - 1):
        pending = start(x.to(DEVICE), slots.to(DEVICE), CodecSpec(), impl)
        with pytest.raises(CodecError, match=r"slots span .* outside the pool's 30 rows") as late:
            pending.finish()
        with pytest.raises(CodecError) as at_once:
            start(x, slots, CodecSpec(), "cpu")
        assert str(late.value) == str(at_once.value)


# Ops that make the host wait for a device tensor's values: reading one, or sizing a result by them.
_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default",
          "aten.masked_select.default", "aten._unique2.default", "aten.unique_consecutive.default"}


class DeviceReads(TorchDispatchMode):
    """Every op that would make the host wait for the device if `sources` were on one: a read of
    a value derived from them (`item`, `int`, `bool`...), or an op whose result's size depends on
    such values (a boolean mask, `nonzero`, `repeat_interleave` without its size). Tensors made
    on the host (constants, host-computed indices) are not followed."""

    def __init__(self, *sources: torch.Tensor):
        super().__init__()
        self.derived = {id(t) for t in sources}
        self.alive = list(sources)  # ids stay unique while the mode runs
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        out = func(*args, **kwargs)
        if any(id(a) in self.derived for a in inputs):
            name = str(func)
            sized_by_values = (
                name in _READS
                or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None)
                or (name.startswith("aten.index") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in tree_leaves(args[1:]))))
            if sized_by_values:
                where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                         for f in traceback.extract_stack()[-8:-1]]
                self.reads.append(f"{name} at {' < '.join(reversed(where))}")
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.derived.add(id(t))
                    self.alive.append(t)
        return out


@pytest.mark.skipif("triton" not in IMPLS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("target", ["int8", "exact"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_serving_encode_reads_no_pool_value_back(monkeypatch, target, dtype):
    from lynx_kernels import exact_triton

    # The exact Residual's coder as a CUDA pool gets it (a CPU pool gets the torch reference).
    monkeypatch.setattr(wire_write, "section_coder",
                        lambda device: (exact_triton.encode_sections, exact_triton.decode_sections))
    x = (torch.randn(90, 2, 64) * 3).to(dtype)
    slots = torch.randperm(90)[:70]
    with DeviceReads(x, slots) as reads:
        pending = start(x, slots, CodecSpec(target=target), "triton", kind="k")
    pending.finish()
    # The exact coder's one wait, for its records' offsets (`ends.tolist()`), is no dispatched op.
    assert reads.reads == []
