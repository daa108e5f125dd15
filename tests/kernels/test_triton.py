"""Triton kernels (lynx_kernels.ops_triton) against the torch reference, bit for bit.

On this CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
when there is no GPU), so inputs stay small; on a CUDA machine they compile (launched with
enable_fp_fusion=False, so the dequant's multiply-add stays two roundings like the reference).
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import bits, make_run

from lynx_kernels import CodecSpec, decode, encode, refine_

triton = pytest.importorskip("triton", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind,k_grouping", [("k", "channel"), ("k", "token"), ("v", "channel")])
@pytest.mark.parametrize("anchor_bits", [2, 3, 4, 5, 6])
def test_triton_matches_reference(dtype, kind, k_grouping, anchor_bits):
    gen = torch.Generator().manual_seed(anchor_bits * 7 + len(kind))
    x = (torch.randn((77, 3, 64), generator=gen) * 3).to(dtype).to(DEVICE)
    spec = CodecSpec(anchor_bits=anchor_bits, group_size=32, k_grouping=k_grouping,
                     sink_tokens=2, recent_tokens=5, rotate=anchor_bits % 2 == 0)
    ref = encode(x, spec, kind, impl="torch")
    tri = encode(x, spec, kind, impl="triton")
    assert torch.equal(tri.anchor, ref.anchor), "anchor codes differ"
    assert torch.equal(tri.residual, ref.residual), "residual codes differ"
    assert torch.equal(tri.zero, ref.zero) and torch.equal(tri.scale, ref.scale)
    for stage in ("anchor", "full"):
        expected = bits(decode(ref, stage, impl="torch"))
        assert torch.equal(bits(decode(ref, stage, impl="triton")), expected), stage


def test_triton_refine_in_place():
    x = torch.randn((128, 2, 64), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    enc = encode(x, CodecSpec(), "v", impl="triton")
    slots = decode(enc, "anchor", impl="triton")
    refine_(slots, enc, impl="triton")
    assert torch.equal(bits(slots), bits(decode(enc, "full", impl="torch")))


@pytest.mark.parametrize("target", ["int8", "exact"])
def test_fused_triton_matches_torch(target):
    x = (torch.randn((70, 2, 64), generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16)
    run = make_run(x.to(DEVICE), CodecSpec(target=target, group_size=32), "k", 32)
    run = type(run)(run.pool.to(DEVICE), run.slots.to(DEVICE), run.spec, run.kind, run.chunk_tokens)
    assert run.encode("triton") == run.encode("torch")
    anchor, residual = run.encode("torch")
    for args in ((anchor,), (anchor, residual)):
        assert torch.equal(bits(run.apply("triton", *args)), bits(run.apply("torch", *args)))
