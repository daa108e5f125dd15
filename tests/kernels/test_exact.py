"""The exact Residual, format v2 (lynx_kernels.exact through lynx_kernels.wire), on the torch
reference: bit-exact round trips, adversarial values, the raw fallback and the size bound, and
rejection of corrupt sections."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_cases import DTYPES, adversarial, bits, chunks_of, make_run, reseal

from lynx_kernels import CodecError, CodecSpec, assemble, decode, encode, parse_chunk, to_chunks
from lynx_kernels.exact import BLOCK, K_TABLE_BYTES
from lynx_kernels.wire import WireStream


def roundtrip(x: torch.Tensor, spec: CodecSpec, kind: str, chunk_tokens: int = 64):
    enc = encode(x, spec, kind, impl="torch")
    anchors = to_chunks(enc, chunk_tokens)
    residuals = to_chunks(enc, chunk_tokens, stream="residual")
    back = assemble(anchors + residuals)
    return decode(back, "full", impl="torch"), residuals


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "k_grouping"), [("k", "channel"), ("k", "token"), ("v", "channel")])
@pytest.mark.parametrize("rotate", [True, False])
def test_exact_roundtrip_every_dtype_and_grouping(dtype, kind, k_grouping, rotate):
    x = (torch.randn(300, 3, 64, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    spec = CodecSpec(target="exact", k_grouping=k_grouping, rotate=rotate, group_size=32)
    full, residuals = roundtrip(x, spec, kind)
    assert torch.equal(bits(full), bits(x))
    # Corrections of Gaussian values: ~3 bits/value for bf16, ~6 for fp16, ~19 for fp32.
    limit = {torch.bfloat16: 0.5, torch.float16: 0.7, torch.float32: 0.8}[dtype]
    for chunk in residuals:
        header = parse_chunk(chunk).header
        assert not header.raw and header.payload_len < limit * header.bound()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_exact_roundtrip_properties(data):
    head_dim = data.draw(st.sampled_from([32, 64, 128]))
    kind = data.draw(st.sampled_from(["k", "v"]))
    k_grouping = data.draw(st.sampled_from(["channel", "token"]))
    group = data.draw(st.sampled_from([g for g in (32, 64, 128)
                                       if g <= head_dim or (kind == "k" and k_grouping == "channel")]))
    spec = CodecSpec(anchor_bits=data.draw(st.integers(2, 6)), group_size=group, target="exact",
                     k_grouping=k_grouping, sink_tokens=data.draw(st.integers(0, 5)),
                     recent_tokens=data.draw(st.integers(0, 30)), rotate=data.draw(st.booleans()),
                     rotation_seed=data.draw(st.integers(0, 2**32 - 1)))
    tokens = data.draw(st.integers(1, 600))
    heads = data.draw(st.integers(1, 8))
    dtype = data.draw(st.sampled_from(DTYPES))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 300.0]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    x = (torch.randn(tokens, heads, head_dim, generator=gen) * scale).to(dtype)
    chunk_tokens = group * data.draw(st.integers(1, 4))
    full, _ = roundtrip(x, spec, kind, chunk_tokens)
    assert torch.equal(bits(full), bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotate", [True, False])
def test_exact_adversarial_values_roundtrip(dtype, rotate):
    spec = CodecSpec(target="exact", rotate=rotate, group_size=32, sink_tokens=2, recent_tokens=3)
    for name, x in adversarial(dtype, 70, 2, 64).items():
        for kind in "kv":
            full, _ = roundtrip(x, spec, kind, 32)
            assert torch.equal(bits(full), bits(x)), (name, kind)


def test_head_dim_32_group_32_and_wide_heads():
    for head_dim in (32, 256):
        x = torch.randn(90, 2, head_dim).to(torch.bfloat16)
        spec = CodecSpec(target="exact", group_size=32)
        for kind in "kv":
            assert torch.equal(bits(roundtrip(x, spec, kind, 32)[0]), bits(x))


def test_incompressible_chunk_goes_raw_within_the_bound():
    """Values spread over every exponent make corrections as long as the values: the chunk is sent
    raw (flagged) and the stream never exceeds the raw-values bound."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 2**16, (64, 2, 64), generator=gen, dtype=torch.int32).to(torch.int16)
    x = x.view(torch.bfloat16)
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    spec = CodecSpec(target="exact", rotate=False, sink_tokens=0, recent_tokens=0)
    full, residuals = roundtrip(x, spec, "v", 32)
    assert torch.equal(bits(full), bits(x))
    headers = [parse_chunk(c).header for c in residuals]
    assert any(h.raw for h in headers)
    assert all(h.payload_len <= h.bound() for h in headers)


def test_nan_is_refused_with_its_position():
    x = torch.randn(40, 2, 64)
    x[17, 1, 9] = torch.nan
    with pytest.raises(CodecError, match=r"layer 4 K: NaN value nan at token 17, head 1, channel 9"):
        encode(x, CodecSpec(target="exact"), "k", layer=4)


def test_int8_still_refuses_unrepresentable_values():
    x = torch.randn(40, 2, 64)
    x[3, 0, 0] = torch.inf
    with pytest.raises(CodecError, match="non-finite value inf"):
        encode(x, CodecSpec(target="int8"), "k")
    with pytest.raises(CodecError, match="fp16"):
        encode(torch.full((40, 2, 64), 7e4), CodecSpec(target="int8", rotate=False), "k")


def coded_chunk() -> tuple[list[bytes], bytes]:
    """Anchor chunks and one coded exact Residual chunk (several records, some escapes)."""
    x = torch.randn(128, 2, 64) * 3
    x[40:44, 0, :8] = 5000.0  # escapes
    enc = encode(x.to(torch.bfloat16), CodecSpec(target="exact", sink_tokens=0, recent_tokens=0), "v")
    return to_chunks(enc, 128), to_chunks(enc, 128, stream="residual")[0]


def sections(chunk: bytes) -> dict[str, slice]:
    h = parse_chunk(chunk).header
    at = h.low_bits_nbytes
    blocks = -(-h.coded_values // BLOCK)
    return {"low": slice(0, at), "k_table": slice(at, at + K_TABLE_BYTES),
            "rec_len": slice(at + K_TABLE_BYTES, at + K_TABLE_BYTES + 2 * blocks),
            "records": slice(at + K_TABLE_BYTES + 2 * blocks, h.payload_len)}


@pytest.mark.parametrize("section", ["low", "k_table", "rec_len", "records"])
def test_bit_flips_in_each_section_are_caught(section):
    """Without a fixed-up CRC every flip is rejected (by the CRC, or by the record lengths' sum);
    with one, structural checks catch what they can and never read out of bounds (the decoded
    values then simply differ)."""
    anchors, chunk = coded_chunk()
    span = sections(chunk)[section]
    payload = bytearray(chunk[54:])
    for i in range(span.start, span.stop, max(1, (span.stop - span.start) // 25)):
        for bit in (0, 5):
            tampered = bytearray(chunk)
            tampered[54 + i] ^= 1 << bit
            with pytest.raises(CodecError, match=r"checksum|record lengths"):
                parse_chunk(bytes(tampered))
            payload[i] ^= 1 << bit
            with contextlib.suppress(CodecError):
                assemble([*anchors, reseal(chunk, bytes(payload))])
            payload[i] ^= 1 << bit


def test_truncated_and_padded_sections_are_rejected():
    anchors, chunk = coded_chunk()
    payload = chunk[54:]
    for bad in (payload[:-1], payload[:-7], payload + b"\0", payload[: sections(chunk)["records"].start]):
        with pytest.raises(CodecError):
            assemble([*anchors, reseal(chunk, bad)])


def test_bad_record_lengths_are_rejected():
    anchors, chunk = coded_chunk()
    span = sections(chunk)["rec_len"]
    lengths = bytearray(chunk[54:][span])
    assert len(lengths) >= 4
    lengths[0] += 1  # first record one byte longer, second one shorter: the sum still matches
    lengths[2] -= 1
    payload = chunk[54:][: span.start] + bytes(lengths) + chunk[54:][span.stop:]
    with pytest.raises(CodecError, match="corrupt exact Residual"):
        assemble([*anchors, reseal(chunk, payload)])
    lengths[0] += 1  # now the sum is off too
    payload = chunk[54:][: span.start] + bytes(lengths) + chunk[54:][span.stop:]
    with pytest.raises(CodecError, match="record lengths"):
        parse_chunk(reseal(chunk, payload))


def test_unary_longer_than_an_escape_is_rejected():
    anchors, chunk = coded_chunk()
    span = sections(chunk)["records"]
    payload = bytearray(chunk[54:])
    payload[span.start: span.stop] = b"\xff" * (span.stop - span.start)
    with pytest.raises(CodecError, match="corrupt exact Residual"):
        assemble([*anchors, reseal(chunk, bytes(payload))])


def test_raw_flag_outside_an_exact_residual_is_rejected():
    enc = encode(torch.randn(64, 2, 64), CodecSpec(target="int8"), "v")
    for chunk in (to_chunks(enc, 64)[0], to_chunks(enc, 64, stream="residual")[0]):
        flags = parse_chunk(chunk).header
        assert not flags.raw
        with pytest.raises(CodecError, match="flags"):
            parse_chunk(reseal(chunk, flags=chunk[8] | 8))


def test_version_1_chunks_are_refused():
    anchors, chunk = coded_chunk()
    for c in (anchors[0], chunk):
        with pytest.raises(CodecError, match="version 1, this codec reads 2: prefill and decode"):
            parse_chunk(reseal(c, version=1))


def test_fused_torch_matches_the_chunked_api_bytes():
    x = (torch.randn(200, 2, 64) * 2).to(torch.float16)
    spec = CodecSpec(target="exact", group_size=32)
    run = make_run(x, spec, "k", 64)
    anchor, residual = run.encode("torch")
    enc = encode(run.values(), spec, "k", layer=run.layer, impl="torch")
    assert anchor == b"".join(to_chunks(enc, 64, request_tag=run.tag))
    assert residual == b"".join(to_chunks(enc, 64, stream="residual", request_tag=run.tag))
    assert all(parse_chunk(c).header.stream is WireStream.RESIDUAL for c in chunks_of(residual))
    pool = run.apply("torch", anchor, residual)
    assert torch.equal(bits(pool[run.slots]), bits(x))
