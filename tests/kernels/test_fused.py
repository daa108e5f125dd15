"""The fused run API (lynx_kernels.fused): the C kernels (impl="cpu") against the torch reference,
bit for bit on every wire byte and every pool value, on random and adversarial inputs; argument
and chunk validation (nothing written on error); the C CRC-32."""

from __future__ import annotations

import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DTYPES, Run, adversarial, bits, chunks_of, make_run, reseal

from lynx_kernels import CodecError, CodecSpec, fused, ops_cpu

pytestmark = pytest.mark.skipif(not ops_cpu.available(),
                                reason=f"C kernels not built: {ops_cpu.unavailable_reason()}")


def same_everywhere(run: Run) -> None:
    """C and torch agree on the bytes and on both pool states; exact gets the values back."""
    c_anchor, c_residual = run.encode("cpu")
    t_anchor, t_residual = run.encode("torch")
    assert c_anchor == t_anchor, "Anchor bytes differ"
    assert c_residual == t_residual, "Residual bytes differ"
    for impl in ("cpu", "torch"):
        assert run.encode_anchor_only(impl) == c_anchor, f"{impl} Anchor-only bytes differ"
    for stage in ("anchor", "residual"):
        args = (c_anchor,) if stage == "anchor" else (c_anchor, c_residual)
        c_pool, t_pool = run.apply("cpu", *args), run.apply("torch", *args)
        assert torch.equal(bits(c_pool), bits(t_pool)), f"{stage} values differ"
        untouched = torch.ones(len(run.pool), dtype=torch.bool)
        untouched[run.slots] = False
        assert bool((c_pool[untouched] == 3.0).all()), "wrote outside the slots"
    if run.spec.target.value == "exact":
        assert torch.equal(bits(c_pool[run.slots]), bits(run.values()))


@st.composite
def runs(draw):
    kind = draw(st.sampled_from(["k", "v"]))
    k_grouping = draw(st.sampled_from(["channel", "token"]))
    per_token = kind == "v" or k_grouping == "token"
    group = draw(st.sampled_from([32, 64, 128]))
    head_dim = draw(st.sampled_from([d for d in (8, 16, 32, 64, 128, 256)
                                     if not per_token or d % group == 0]))
    rotate = draw(st.booleans())
    spec = CodecSpec(
        anchor_bits=draw(st.integers(2, 6)), group_size=group,
        target=draw(st.sampled_from(["int8", "exact"])), k_grouping=k_grouping,
        sink_tokens=draw(st.integers(0, 6)), recent_tokens=draw(st.integers(0, 40)),
        rotate=rotate, rotation_seed=draw(st.integers(0, 2**32 - 1)),
    )
    tokens = draw(st.integers(1, 600))
    heads = draw(st.integers(1, 8 if head_dim <= 128 else 2))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn((tokens, heads, head_dim), generator=gen) * draw(st.sampled_from([1e-3, 1.0, 50.0]))
    if draw(st.booleans()):
        x[0] *= 40  # an attention-sink-like token
    chunk_tokens = group * draw(st.integers(1, 4)) if spec.groups_over_tokens(kind) else \
        draw(st.integers(1, 300))
    return make_run(x.to(dtype), spec, kind, chunk_tokens, seed=tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_c_matches_torch(run):
    same_everywhere(run)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize(("kind", "k_grouping"), [("k", "channel"), ("k", "token"), ("v", "channel")])
def test_c_matches_torch_on_adversarial_values(dtype, rotate, kind, k_grouping):
    spec = CodecSpec(target="exact", rotate=rotate, k_grouping=k_grouping, group_size=32,
                     sink_tokens=2, recent_tokens=3)
    for x in adversarial(dtype, 70, 2, 64).values():
        same_everywhere(make_run(x, spec, kind, 32))


@pytest.mark.parametrize(("heads", "group_size"), [(8, 32), (8, 64), (5, 32), (3, 128)])
def test_per_token_groups_sixteen_at_a_time_and_the_rest(heads, group_size):
    """The C encoder reduces a row's per-token groups sixteen at a time with 512-bit vectors,
    eight at a time without (row_minmax8), the rest one by one: 32, 16, 20 and 3 groups a row,
    each group's extremes at random lanes."""
    x = torch.randn(40, heads, 128) * torch.rand(40, heads, 1) * 10
    for target in ("int8", "exact"):
        spec = CodecSpec(target=target, group_size=group_size)
        same_everywhere(make_run(x.to(torch.bfloat16), spec, "v", 32))


@pytest.mark.parametrize("head_dim", [8, 96, 256])
def test_uncommon_head_dims(head_dim):
    x = torch.randn(50, 2, head_dim).to(torch.bfloat16)
    for target in ("int8", "exact"):
        spec = CodecSpec(target=target, group_size=32, rotate=head_dim != 96)
        for kind in "kv":
            if kind == "v" and head_dim % 32:
                continue
            same_everywhere(make_run(x, spec, kind, 32))


@pytest.mark.parametrize(("target", "value", "message"), [
    ("exact", torch.nan, "NaN value nan at token 5, head 1, channel 3"),
    ("int8", torch.inf, "non-finite value inf at token 5, head 1, channel 3"),
    ("int8", 1e6, "fp16"),  # rotated: spread over the head, still beyond 65504
])
def test_refused_input_is_named_by_both(target, value, message):
    x = torch.randn(20, 2, 64)
    x[5, 1, 3] = value
    run = make_run(x, CodecSpec(target=target), "v", 16)
    for impl in ("cpu", "torch"):
        with pytest.raises(CodecError, match=message):
            run.encode(impl)


def test_chunk_validation_agrees_and_writes_nothing():
    x = (torch.randn(200, 2, 64) * 2).to(torch.bfloat16)
    x[50:52, 0, :4] = 9000.0  # escapes in the first Residual chunk's records
    run = make_run(x, CodecSpec(target="exact", group_size=32), "k", 64)
    anchor, residual = run.encode("cpu")
    a_chunks, r_chunks = chunks_of(anchor), chunks_of(residual)
    other = make_run(x, CodecSpec(target="exact", group_size=32), "k", 64)
    bad_anchors = {
        "dropped": b"".join(a_chunks[1:]),
        "swapped": b"".join([a_chunks[1], a_chunks[0], *a_chunks[2:]]),
        "truncated": anchor[:-1],
        "trailing": anchor + b"\0",
        "wrong tag": b"".join([reseal(a_chunks[0], tag=5), *a_chunks[1:]]),
        "wrong layer": b"".join([reseal(a_chunks[0], layer=9), *a_chunks[1:]]),
        "version 1": b"".join([reseal(a_chunks[0], version=1), *a_chunks[1:]]),
        "flipped": anchor[:100] + bytes([anchor[100] ^ 4]) + anchor[101:],
        "residual as anchor": residual,
    }
    for name, bad in bad_anchors.items():
        for impl in ("cpu", "torch"):
            pool = other.pool.clone()
            with pytest.raises(CodecError):
                run.apply(impl, bad, into=pool)
            with pytest.raises(CodecError):
                run.apply(impl, bad, residual, into=pool)
            assert torch.equal(bits(pool), bits(other.pool)), (name, impl)
    payload = bytearray(r_chunks[0][54:])
    outcomes = {}
    for i in range(0, len(payload), 97):
        payload[i] ^= 0x10
        tampered = b"".join([reseal(r_chunks[0], bytes(payload)), *r_chunks[1:]])
        payload[i] ^= 0x10
        for impl in ("cpu", "torch"):
            pool = other.pool.clone()
            try:
                run.apply(impl, anchor, tampered, into=pool)
                outcomes[impl] = bits(pool)
            except CodecError:
                outcomes[impl] = None
                assert torch.equal(bits(pool), bits(other.pool)), (i, impl)
        c, t = outcomes["cpu"], outcomes["torch"]
        assert (c is None) == (t is None), f"byte {i}: C and torch disagree on rejecting"
        assert c is None or torch.equal(c, t), f"byte {i}: C and torch decode differently"
    with pytest.raises(CodecError, match=r"no Anchor chunk|tile"):
        run.apply("cpu", anchor, b"".join([r_chunks[0], r_chunks[2], r_chunks[1], *r_chunks[3:]]))


def test_arguments_are_checked():
    x = torch.randn(64, 2, 64)
    run = make_run(x, CodecSpec(), "v", 32)
    sizes = fused.run_nbytes(run.spec, "v", x.dtype, 2, 64, 64, 32)
    small = np.zeros(sizes.anchor - 1, np.uint8)
    enough = np.zeros(sizes.residual_bound, np.uint8)
    args = (run.pool, run.slots, run.spec, "v", 0, 32, 1)
    for impl in ("cpu", "torch"):
        with pytest.raises(CodecError, match="anchor_out holds"):
            fused.encode_run_into(*args, small, enough, impl=impl)
        with pytest.raises(CodecError, match="read-only"):
            fused.encode_run_into(*args, bytes(sizes.anchor), enough, impl=impl)
        with pytest.raises(CodecError, match="outside the pool"):
            fused.encode_run_into(run.pool, run.slots + 100, *args[2:], np.zeros(sizes.anchor, np.uint8),
                                  enough, impl=impl)
        with pytest.raises(CodecError, match="int64"):
            fused.encode_run_into(run.pool, run.slots.int(), *args[2:], small, enough, impl=impl)
        with pytest.raises(CodecError, match="needs as many slots"):
            fused.apply_anchor_run(b"", run.pool, run.slots, run.spec, "v", 0, 1, 63, impl=impl)
    strided = torch.zeros(len(run.pool), 2, 128)[:, :, :64]  # rows of [heads, head_dim] not dense
    with pytest.raises(CodecError, match="contiguous"):
        fused.encode_run_into(strided, *args[1:], np.zeros(sizes.anchor, np.uint8), enough,
                              impl="cpu")
    with pytest.raises(CodecError, match="impl must be"):
        fused.encode_run_into(*args, small, enough, impl="gpu")


def test_auto_uses_c_and_falls_back_with_one_warning(monkeypatch):
    run = make_run(torch.randn(40, 2, 64), CodecSpec(), "v", 32)
    assert fused._resolve("auto", run.pool) == "cpu"
    monkeypatch.setattr(ops_cpu, "available", lambda: False)
    fused._warn_torch_fallback.cache_clear()
    with pytest.warns(RuntimeWarning, match="torch reference"):
        assert fused._resolve("auto", run.pool) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused._resolve("auto", run.pool) == "torch"
    with pytest.raises(CodecError, match="C extension"):
        fused._resolve("cpu", run.pool)


def test_c_crc32_is_zlibs():
    """Every path: tables (< 64 B and the tail), 128-bit folds (64-255 B, or any length without
    VPCLMULQDQ), 512-bit folds (>= 256 B on a CPU with AVX-512 and VPCLMULQDQ), at unaligned
    starts too."""
    gen = np.random.default_rng(3)
    buf = gen.integers(0, 256, 100_100, dtype=np.uint8).tobytes()
    for n in (0, 1, 15, 16, 63, 64, 65, 127, 128, 200, 255, 256, 257, 271, 511, 512, 767, 1000,
              4096 + 7, 100_000):
        for offset in (0, 3):
            data = buf[offset: offset + n]
            for start in (0, 0x12345678):
                assert ops_cpu.crc32(data, start) == zlib.crc32(data, start), (n, offset)
