"""Chunked wire format (lynx_kernels.wire): reassembly in any order, and rejection of bad chunks."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lynx_kernels import (
    CodecError,
    CodecSpec,
    WireStream,
    assemble,
    decode,
    encode,
    parse_chunk,
    to_chunks,
    wire_nbytes,
    write_chunks,
)
from lynx_kernels.wire import FORMAT_VERSION, HEADER, DeviceCopy


@st.composite
def encoded_runs(draw):
    spec = CodecSpec(
        anchor_bits=draw(st.integers(2, 6)), group_size=draw(st.sampled_from([32, 64])),
        target=draw(st.sampled_from(["int8", "exact"])),
        k_grouping=draw(st.sampled_from(["channel", "token"])),
        sink_tokens=draw(st.integers(0, 4)), recent_tokens=draw(st.integers(0, 40)),
        rotate=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(["k", "v"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    tokens = draw(st.integers(1, 300))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn((tokens, 2, 64), generator=gen).to(dtype)
    chunk_tokens = spec.group_size * draw(st.integers(1, 4))
    return encode(x, spec, kind, layer=draw(st.integers(0, 80))), chunk_tokens, draw(
        st.randoms(use_true_random=False))


@settings(max_examples=60, deadline=None)
@given(encoded_runs())
def test_chunks_in_any_order_decode_identically(run):
    enc, chunk_tokens, rnd = run
    chunks = to_chunks(enc, chunk_tokens, request_tag=42) + to_chunks(
        enc, chunk_tokens, stream="residual", request_tag=42)
    rnd.shuffle(chunks)
    back = assemble(chunks)
    for stage in ("anchor", "full"):
        assert torch.equal(decode(back, stage), decode(enc, stage))
    assert back.nbytes("anchor") == enc.nbytes("anchor")
    assert back.nbytes("residual") == enc.nbytes("residual")
    anchors_only = [c for c in chunks if parse_chunk(c).header.stream is WireStream.ANCHOR]
    assert torch.equal(decode(assemble(anchors_only), "anchor"), decode(enc, "anchor"))


@settings(max_examples=30, deadline=None)
@given(encoded_runs())
def test_a_device_copy_of_the_landed_bytes_assembles_the_same_run(run):
    """`fused.apply_*` on a device pool copy each stream's landed bytes over once
    (`DeviceCopy`) and slice the pieces out of that copy; here the "device" is the CPU. The host
    bytes are wiped after the copy, so a piece that was not sliced out of it would show."""
    enc, chunk_tokens, _ = run
    streams = {}
    for stream in ("anchor", "residual"):
        buf = np.zeros(enc.nbytes(stream) * 2 + 4096, dtype=np.uint8)
        lengths = write_chunks(enc, chunk_tokens, buf, stream=stream, request_tag=5)
        streams[stream] = (buf, lengths)
    chunks = []
    for buf, lengths in streams.values():
        at = 0
        for n in lengths:
            chunks.append(parse_chunk(memoryview(buf)[at: at + n]))
            at += n
    copy = DeviceCopy([buf for buf, _ in streams.values()], "cpu")
    for buf, _ in streams.values():
        buf[:] = 0  # the landed bytes are the copy's alone now
    back = assemble(chunks, copy=copy)
    for stage in ("anchor", "full"):
        assert torch.equal(decode(back, stage), decode(enc, stage))
    assert copy.piece(memoryview(bytes(8))) is None  # bytes outside the buffers: not the copy's
    assert copy.join([memoryview(bytes(8))]) is None


@settings(max_examples=60, deadline=None)
@given(encoded_runs(), st.data())
def test_any_corrupted_byte_is_rejected(run, data):
    enc, chunk_tokens, _ = run
    chunk = bytearray(data.draw(st.sampled_from(
        to_chunks(enc, chunk_tokens) + to_chunks(enc, chunk_tokens, stream="residual"))))
    position = data.draw(st.integers(0, len(chunk) - 1))
    chunk[position] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CodecError):
        parse_chunk(chunk)


def one_chunk():
    enc = encode(torch.randn(100, 2, 64), CodecSpec(), "v", layer=3)
    return enc, to_chunks(enc, 64)


@pytest.mark.parametrize("cut", [0, 10, HEADER.size, HEADER.size + 5, -1])
def test_truncated_chunk_is_rejected(cut):
    _, chunks = one_chunk()
    with pytest.raises(CodecError, match=r"truncated|payload is"):
        parse_chunk(chunks[0][:cut])


def test_trailing_bytes_are_rejected():
    _, chunks = one_chunk()
    with pytest.raises(CodecError, match="trailing"):
        parse_chunk(chunks[0] + b"\0")


def test_wrong_magic_and_version_are_named():
    _, chunks = one_chunk()
    with pytest.raises(CodecError, match="not a Lynx chunk"):
        parse_chunk(b"XXXX" + chunks[0][4:])
    with pytest.raises(CodecError, match="format version 9"):
        parse_chunk(chunks[0][:4] + bytes([9]) + chunks[0][5:])


def test_consistent_header_with_wrong_length_is_rejected():
    """A header rewritten consistently (CRC fixed up) but claiming a different range."""
    _, chunks = one_chunk()
    fields = list(HEADER.unpack(chunks[0][:HEADER.size]))
    fields[17] += 1  # token_end: the payload no longer matches the range
    with pytest.raises(CodecError, match="payload_len"):
        parse_chunk(HEADER.pack(*fields) + chunks[0][HEADER.size:])


def test_chunks_of_different_runs_do_not_mix():
    enc_a = encode(torch.randn(128, 2, 64), CodecSpec(), "v", layer=1)
    enc_b = encode(torch.randn(128, 2, 64), CodecSpec(), "v", layer=2)
    with pytest.raises(CodecError, match="does not belong"):
        assemble([to_chunks(enc_a, 64)[0], to_chunks(enc_b, 64)[1]])


def test_gaps_and_overlaps_are_rejected():
    enc = encode(torch.randn(256, 2, 64), CodecSpec(), "v")
    chunks = to_chunks(enc, 64)
    with pytest.raises(CodecError, match="do not tile"):
        assemble([chunks[0], chunks[2]])
    with pytest.raises(CodecError, match="do not tile"):
        assemble([chunks[0], chunks[0]])
    residual = to_chunks(enc, 64, stream="residual")
    with pytest.raises(CodecError, match="Residual chunks cover"):
        assemble([*chunks, *residual[:3]])


def test_k_channel_chunks_must_align_to_groups():
    enc = encode(torch.randn(256, 2, 64), CodecSpec(), "k")
    with pytest.raises(CodecError, match="multiple of group_size"):
        to_chunks(enc, 100)


def test_chunk_header_carries_codec_parameters():
    spec = CodecSpec(anchor_bits=3, group_size=32, target="exact", k_grouping="token",
                     sink_tokens=4, recent_tokens=16, rotate=True, rotation_seed=1234)
    enc = encode(torch.randn(90, 3, 64, dtype=torch.bfloat16), spec, "k", layer=29)
    header = parse_chunk(to_chunks(enc, 32, request_tag=2**63 + 5)[1]).header
    assert header.spec == spec
    assert (header.layer, header.kind.value, header.dtype) == (29, "k", torch.bfloat16)
    assert (header.token_start, header.token_end, header.total_tokens) == (32, 64, 90)
    assert header.request_tag == 2**63 + 5


def test_header_layout_is_pinned():
    """Changing the header layout or the payloads must come with a FORMAT_VERSION bump; version 2
    kept version 1's header layout (it added the "raw" flag bit) and changed the rotation and the
    exact Residual."""
    assert FORMAT_VERSION == 2
    assert HEADER.format == "<4sBBBBBBHHHHHHIQIIIII" and HEADER.size == 54


def test_stream_bytes_are_pinned():
    """The chunks and the Anchor reconstruction of a fixed input, byte for byte: a faster codec must
    not change what goes on the wire. Re-pinned for wire format 2 (deliberately): every header's
    version byte changed, and target exact's Residual became low bits + correction section instead
    of the values. (Without rotation the int8 payloads and the Anchor are version 1's.)"""
    digest = hashlib.sha256()
    for dtype in (torch.float32, torch.bfloat16):
        x = ((torch.arange(300 * 2 * 64) * 7919 % 1001 - 500) / 64.0).reshape(300, 2, 64).to(dtype)
        for target in ("int8", "exact"):
            for k_grouping in ("channel", "token"):
                spec = CodecSpec(anchor_bits=3, group_size=32, target=target,
                                 k_grouping=k_grouping, sink_tokens=4, recent_tokens=16,
                                 rotate=False)
                for kind in "kv":
                    enc = encode(x, spec, kind, layer=5)
                    for stream in ("anchor", "residual"):
                        for chunk in to_chunks(enc, 64, stream=stream, request_tag=9):
                            digest.update(chunk)
                    digest.update(decode(enc, "anchor").contiguous().view(torch.uint8).numpy())
    assert digest.hexdigest() == "6d07a1447823e4f9825f2b910abb654b57462e942f93d04fad8016630bf030bf"


@settings(max_examples=30, deadline=None)
@given(encoded_runs(), st.sampled_from(["anchor", "residual"]))
def test_write_chunks_places_the_to_chunks_bytes(run, stream):
    enc, chunk_tokens, _ = run
    chunks = to_chunks(enc, chunk_tokens, stream=stream, request_tag=3)
    total = sum(len(c) for c in chunks)
    buf = np.full(total + 20, 0xAB, dtype=np.uint8)
    lengths = write_chunks(enc, chunk_tokens, buf[7:], stream=stream, request_tag=3)
    assert lengths == [len(c) for c in chunks]
    assert buf[7: 7 + total].tobytes() == b"".join(chunks)
    assert (buf[:7] == 0xAB).all() and (buf[7 + total:] == 0xAB).all()
    with pytest.raises(CodecError, match="too small"):
        write_chunks(enc, chunk_tokens, bytearray(total - 1), stream=stream)


def test_wire_nbytes_is_what_the_wire_carries():
    """`EncodedKV.nbytes` is the bytes in memory; `wire_nbytes` what `to_chunks` puts on the wire.
    They agree for the int8 target (chunk headers aside); for exact the wire codes the Residual
    into fewer bytes than the uncoded values (real KV is smooth; so is this ramp)."""
    x = (torch.arange(256 * 2 * 64).reshape(256, 2, 64) % 97 / 32.0 - 1.5).to(torch.bfloat16)
    headers = 4 * HEADER.size  # 256 tokens in chunks of 64
    for target in ("int8", "exact"):
        enc = encode(x, CodecSpec(anchor_bits=4, group_size=64, target=target), "v", layer=0)
        for stream in ("anchor", "residual"):
            assert wire_nbytes(enc, 64, stream=stream) == sum(
                len(c) for c in to_chunks(enc, 64, stream=stream))
        assert wire_nbytes(enc, 64, stream="anchor") == enc.nbytes("anchor") + headers
        residual = wire_nbytes(enc, 64, stream="residual")
        if target == "int8":
            assert residual == enc.nbytes("residual") + headers
        else:
            assert residual < 0.7 * enc.nbytes("residual")


def test_a_device_copy_takes_read_only_bytes():
    """Landed bytes handed as `bytes` (read-only): copied once all the same, pieces found by
    where they lie in the caller's buffer."""
    data = bytes(range(256)) * 4
    copy = DeviceCopy([np.frombuffer(data, dtype=np.uint8)], "cpu")
    view = memoryview(data)[100:164]
    assert bytes(copy.piece(view).numpy()) == data[100:164]
    joined = copy.join([memoryview(data)[0:3], memoryview(data)[1020:1024]])
    assert bytes(joined.numpy()) == data[0:3] + data[1020:1024]
