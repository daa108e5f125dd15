"""Property tests of the codec contract (lynx_kernels.codec) on the torch reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lynx_kernels import CodecError, CodecSpec, decode, encode, protected_positions, refine_
from lynx_kernels.codec import unrepresentable_limit
from lynx_kernels.ops_torch import quantize_codes, unpack_bits
from lynx_kernels.rotation import rotate

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Unit roundoff of each dtype: the extra error of rounding a dequantized fp32 value into it.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@st.composite
def cases(draw):
    group = draw(st.sampled_from([32, 64, 128]))
    k_grouping = draw(st.sampled_from(["channel", "token"]))
    kind = draw(st.sampled_from(["k", "v"]))
    per_token = kind == "v" or k_grouping == "token"
    head_dim = draw(st.sampled_from([d for d in (8, 16, 32, 64, 128)
                                     if not per_token or d % group == 0]))
    spec = CodecSpec(
        anchor_bits=draw(st.integers(2, 6)), group_size=group,
        target=draw(st.sampled_from(["int8", "exact"])), k_grouping=k_grouping,
        sink_tokens=draw(st.integers(0, 6)), recent_tokens=draw(st.integers(0, 20)),
        rotate=draw(st.booleans()), rotation_seed=draw(st.integers(0, 2**32 - 1)),
    )
    tokens = draw(st.integers(1, 260))
    heads = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    x = torch.randn((tokens, heads, head_dim), generator=gen) * magnitude
    if draw(st.booleans()):  # an attention-sink-like outlier token
        x[0] *= 50
    return spec, kind, x.to(dtype)


def joined_codes(enc):
    hd = enc.num_heads * enc.head_dim
    r = enc.spec.residual_bits
    return (unpack_bits(enc.anchor, enc.spec.anchor_bits, hd) << r) | unpack_bits(enc.residual, r, hd)


def expanded(per_group, enc):
    from lynx_kernels.ops_torch import expand_groups

    hd = enc.num_heads * enc.head_dim
    return expand_groups(per_group.float(), enc.num_tokens, hd, enc.spec.group_size,
                         enc.over_tokens).view(enc.num_tokens, enc.num_heads, enc.head_dim)


def step_bound(enc, code_error: float, x: torch.Tensor) -> torch.Tensor:
    """Per-value error bound: `code_error` quantization steps (in the quantized basis; for a rotated
    spec mapped back through the orthonormal rotation as an L2 bound per head row) plus rounding
    into the output dtype."""
    step_error = expanded(enc.scale, enc) * code_error
    if enc.spec.rotate:
        step_error = step_error.norm(dim=-1, keepdim=True).expand_as(step_error)
    rounding = UNIT_ROUNDOFF[enc.dtype] * (x.float().abs() + step_error)
    # fp32 arithmetic in quantize/dequantize/rotation: a few ulps of the values involved.
    arithmetic = 8 * 2.0**-24 * (x.float().abs() + expanded(enc.zero, enc).abs()
                                 + 255 * expanded(enc.scale, enc))
    if enc.spec.rotate:
        arithmetic = arithmetic * math.sqrt(enc.head_dim)
    return step_error + rounding + arithmetic


def unprotected(enc):
    mask = torch.ones(enc.num_tokens, dtype=torch.bool)
    mask[protected_positions(enc.total_tokens, enc.spec.sink_tokens, enc.spec.recent_tokens,
                             0, enc.num_tokens)] = False
    return mask


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_roundtrip_properties(case):
    spec, kind, x = case
    enc = encode(x, spec, kind, impl="torch")
    keep = unprotected(enc)
    anchor = decode(enc, "anchor", impl="torch")
    full = decode(enc, "full", impl="torch")
    assert anchor.shape == x.shape and anchor.dtype == x.dtype
    assert full.shape == x.shape and full.dtype == x.dtype

    # Protected tokens ride in the Anchor at full precision.
    assert torch.equal(anchor[~keep], x[~keep])

    # Anchor error: at most half a bucket of 2**residual_bits codes, plus the code's own half step.
    # Target exact zeroes values fp16 scales cannot cover before quantizing (their Residual carries
    # them), so their Anchor is not bounded: not the value's (no rotation) or its head row's.
    bound = step_bound(enc, 2.0 ** (spec.residual_bits - 1), x)
    err = (anchor.float() - x.float()).abs()
    checked = keep[:, None, None].expand_as(x).clone()
    if spec.target.value == "exact":
        beyond = x.float().abs() >= unrepresentable_limit(spec.rotate, x.shape[-1])
        checked &= ~(beyond.any(-1, keepdim=True).expand_as(x) if spec.rotate else beyond)
    assert bool((err[checked] <= bound[checked]).all()), float((err - bound)[checked].max())

    if spec.target.value == "exact":
        assert torch.equal(full.view(torch.uint8), x.view(torch.uint8)), "exact target not bit-exact"
        return
    # Anchor ⊕ Residual reproduces the INT8 codes of the quantizer exactly.
    x_q = x.float()
    if spec.rotate:
        x_q = rotate(x_q, spec.rotation_seed)
    hd = enc.num_heads * enc.head_dim
    scale = enc.scale.float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = quantize_codes(x_q.reshape(-1, hd), enc.zero.float(), inv, spec.group_size,
                           enc.over_tokens)
    assert torch.equal(joined_codes(enc), codes.to(torch.int64))
    # Full INT8 error: half a quantization step.
    bound = step_bound(enc, 0.5, x)
    err = (full.float() - x.float()).abs()
    assert bool((err[keep] <= bound[keep]).all()), float((err - bound)[keep].max())


@settings(max_examples=40, deadline=None)
@given(cases())
def test_refine_in_place_matches_full_decode(case):
    spec, kind, x = case
    enc = encode(x, spec, kind, impl="torch")
    pool = torch.zeros((x.shape[0] + 3, *x.shape[1:]), dtype=x.dtype)
    slots = pool[2: 2 + x.shape[0]]
    decode(enc, "anchor", impl="torch", out=slots)
    refine_(slots, enc, impl="torch")
    assert torch.equal(pool[2: 2 + x.shape[0]], decode(enc, "full", impl="torch"))
    assert not pool[:2].any() and not pool[-1].any(), "refine wrote outside its slots"


def test_decode_does_not_alias_encoded_memory():
    x = torch.randn(70, 2, 64)
    enc = encode(x, CodecSpec(target="exact", sink_tokens=2), "v")
    out = decode(enc, "full")
    out.zero_()
    assert torch.equal(decode(enc, "full"), x)


def test_constant_groups_decode_exactly():
    x = torch.full((64, 2, 64), 0.75)
    enc = encode(x, CodecSpec(), "k")
    assert torch.equal(decode(enc, "full"), x)
    assert bool((enc.scale == 0).all())


@pytest.mark.parametrize(
    ("make", "kwargs", "message"),
    [
        (lambda: torch.randn(4, 64), {}, "rank 3"),
        (lambda: torch.randn(4, 2, 64).to(torch.float64), {}, "dtype"),
        (lambda: torch.randint(0, 5, (4, 2, 64)), {}, "dtype"),
        (lambda: torch.randn(0, 2, 64), {}, "empty"),
        (lambda: torch.randn(4, 2, 48), {"kind": "v"}, "not divisible by group_size=64"),
        (lambda: torch.randn(4, 2, 12), {}, "multiple of 8"),
        (lambda: torch.randn(4, 2, 64) * 1e5, {"target": "int8"}, "fp16"),
        (lambda: [[1.0]], {}, "torch.Tensor"),
    ],
)
def test_bad_input_is_named(make, kwargs, message):
    """(The int8 target refuses values an fp16 scale cannot hold; exact carries them.)"""
    spec = CodecSpec(target=kwargs.pop("target", "exact"))
    with pytest.raises(CodecError, match=message):
        encode(make(), spec, layer=7, **{"kind": "k", **kwargs})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reports_layer_and_position(bad):
    x = torch.randn(10, 3, 64)
    x[6, 2, 17] = bad
    with pytest.raises(CodecError, match=r"layer 12 V: non-finite value .* token 6, head 2, channel 17"):
        encode(x, CodecSpec(target="int8"), "v", layer=12)
    if bad != bad:  # exact carries ±Inf bit for bit; only NaN is refused
        with pytest.raises(CodecError, match=r"layer 12 V: NaN value .* token 6, head 2, channel 17"):
            encode(x, CodecSpec(target="exact"), "v", layer=12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"anchor_bits": 1}, "anchor_bits"),
        ({"anchor_bits": 7}, "anchor_bits"),
        ({"group_size": 48}, "group_size"),
        ({"target": "int4"}, "target"),
        ({"k_grouping": "head"}, "k_grouping"),
        ({"sink_tokens": -1}, "sink_tokens"),
    ],
)
def test_bad_spec_is_named(kwargs, message):
    with pytest.raises(CodecError, match=message):
        CodecSpec(**kwargs)


def test_rotation_needs_power_of_two_head_dim():
    with pytest.raises(CodecError, match="power-of-two"):
        encode(torch.randn(4, 1, 96), CodecSpec(rotate=True, group_size=32), "v")


def test_full_decode_without_residual_is_refused():
    enc = encode(torch.randn(64, 1, 64), CodecSpec(), "k")
    enc.residual = None
    with pytest.raises(CodecError, match="needs the residual"):
        decode(enc, "full")


def test_out_mismatch_is_refused():
    enc = encode(torch.randn(64, 1, 64), CodecSpec(), "k")
    with pytest.raises(CodecError, match="expected"):
        decode(enc, "anchor", out=torch.empty(64, 1, 64, dtype=torch.float16))


def test_protected_tokens_are_left_out_of_channel_groups():
    x = torch.randn(128, 1, 64)
    x[0] = 1000.0  # an attention-sink outlier
    naive = {"sink_tokens": 0, "recent_tokens": 0, "rotate": False}
    plain = encode(x, CodecSpec(**naive), "k")
    protected = encode(x, CodecSpec(**(naive | {"sink_tokens": 1})), "k")
    keep = slice(1, None)
    err_plain = (decode(plain, "anchor")[keep] - x[keep]).abs().mean()
    err_protected = (decode(protected, "anchor")[keep] - x[keep]).abs().mean()
    assert err_protected < err_plain / 50


@pytest.mark.parametrize("rotate", [True, False])
def test_exact_carries_values_beyond_the_fp16_scales(rotate):
    """A value no fp16 scale covers is zeroed for the Anchor (its row's Anchor is then off by up to
    that value; hypothesis once drew such a row) and restored bit for bit by the Residual."""
    x = torch.randn(40, 2, 128) * 30
    x[0, 1, 5] = 6440.0  # >= 65504 / sqrt(128) = 5790: beyond the limit with the rotation
    if not rotate:
        x[3, 0, 7] = 7.0e4
    spec = CodecSpec(anchor_bits=3, group_size=128, target="exact", sink_tokens=0,
                     recent_tokens=0, rotate=rotate)
    enc = encode(x, spec, "v", impl="torch")
    assert bool(decode(enc, "anchor", impl="torch").isfinite().all())
    assert torch.equal(decode(enc, "full", impl="torch"), x)
