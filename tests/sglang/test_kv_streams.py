"""Prefill pool -> two byte streams -> decode pool, without SGLang (lynx_sglang.backend: streams,
plan, pool, aux)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lynx_kernels import CodecSpec, decode, encode, fused, to_chunks
from lynx_sglang.backend.aux import pack_aux, unpack_aux
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.pool import KINDS, KVPoolView
from lynx_sglang.backend.streams import (
    PendingLayer,
    ResidualReader,
    anchor_layer,
    apply_anchor_layer,
    apply_full_layer,
    encode_layer_into,
)
from lynx_sglang.errors import KVStreamError

LAYERS, HEADS, DIM, SLOTS = 3, 3, 64, 600
CHUNK = 256


def _pool(seed: int) -> KVPoolView:
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randn(SLOTS, HEADS, DIM, generator=g)  # noqa: E731
    return KVPoolView([mk() for _ in range(LAYERS)], [mk() for _ in range(LAYERS)])


def apply_anchor(anchor: memoryview, pool: KVPoolView, slots, spec, request_tag: int,
                 write: bool = True, executor=None):
    """Every layer's Anchor as the decode applier takes it: found at the plan's offsets, then
    validated and written."""
    plan = StreamPlan.build(spec, pool.shape, len(slots), CHUNK)
    if len(anchor) != plan.anchor_bytes:
        raise KVStreamError(f"Anchor of {len(anchor)} B, the plan says {plan.anchor_bytes} B")
    layers = [anchor_layer(anchor, plan, layer) for layer in range(LAYERS)]
    if write:
        for layer, runs in enumerate(layers):
            apply_anchor_layer(runs, pool, layer, slots, spec, request_tag, executor)
    return layers


def apply_residual(residual: memoryview, anchors, pool: KVPoolView, slots, spec,
                   request_tag: int, landed: int | None = None, executor=None) -> int:
    """Feed the Residual stream to a ResidualReader (`landed` bytes of it so far) and write every
    complete layer at full precision; returns the layers written."""
    reader = ResidualReader(LAYERS, len(slots))
    done = 0
    for layer, runs in reader.advance(residual, len(residual) if landed is None else landed):
        apply_full_layer(anchors[layer], runs, pool, layer, slots, spec, request_tag, executor)
        done += 1
    return done


def _reference_layer(pool, layer, slots, spec, chunk_tokens, tag) -> tuple[bytes, bytes]:
    """One layer's streams by the torch reference codec (`encode` + `to_chunks`)."""
    anchor = residual = b""
    for kind in KINDS:
        enc = encode(pool.read(layer, kind, slots), spec, kind.value, layer=layer)
        anchor += b"".join(to_chunks(enc, chunk_tokens, stream="anchor", request_tag=tag))
        residual += b"".join(to_chunks(enc, chunk_tokens, stream="residual", request_tag=tag))
    return anchor, residual


def _streams(pool, slots, spec, chunk_tokens, tag):
    anchor, residual = b"", b""
    for layer in range(LAYERS):
        a, r = _reference_layer(pool, layer, slots, spec, chunk_tokens, tag)
        anchor += a
        residual += r
    return anchor, residual


@pytest.fixture(params=[1, 2], ids=["threads1", "threads2"])
def executor(request):
    """None, or the one-thread helper the sender's --lynx-encode-threads 2 and the applier's
    --lynx-apply-threads 2 run V on; shut down after the test."""
    if request.param == 1:
        yield None
        return
    with ThreadPoolExecutor(1) as helper:
        yield helper


@pytest.mark.parametrize("target", ["exact", "int8"])
@pytest.mark.parametrize("num_tokens", [1, 200, 513])
def test_round_trip(target, num_tokens, executor):
    """With `executor`: the decode's `--lynx-apply-threads 2`, V applied on a helper thread."""
    spec = CodecSpec(anchor_bits=4, group_size=64, target=target)
    src, dst = _pool(0), _pool(1)
    src_slots = torch.randperm(SLOTS)[:num_tokens]
    dst_slots = torch.randperm(SLOTS)[:num_tokens]
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[dst_slots] = False
    before = [t.clone() for t in dst.k]
    anchor, residual = _streams(src, src_slots, spec, 256, tag=7)
    plan = StreamPlan.build(spec, src.shape, num_tokens, 256)
    assert len(anchor) == plan.anchor_bytes
    # The exact Residual is coded (its size depends on the values); the plan gives its bound.
    assert (len(residual) <= plan.residual_bytes if target == "exact"
            else len(residual) == plan.residual_bytes)

    anchors = apply_anchor(memoryview(anchor), dst, dst_slots, spec, request_tag=7,
                           executor=executor)
    for layer in range(LAYERS):
        x = src.k[layer][src_slots]
        expect = decode(encode(x, spec, "k"), "anchor")
        assert torch.equal(dst.k[layer][dst_slots], expect)
        assert torch.equal(dst.k[layer][untouched], before[layer][untouched])

    apply_residual(memoryview(residual), anchors, dst, dst_slots, spec, request_tag=7,
                   executor=executor)
    for layer in range(LAYERS):
        for kind, s, d in (("k", src.k, dst.k), ("v", src.v, dst.v)):
            x = s[layer][src_slots]
            full = decode(encode(x, spec, kind), "full")
            assert torch.equal(d[layer][dst_slots], full)
            if target == "exact":
                assert torch.equal(d[layer][dst_slots], x)
        assert torch.equal(dst.k[layer][untouched], before[layer][untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("target", ["exact", "int8"])
def test_plan_expects_the_residual_size_it_gets(target, dtype):
    """The speculation decision estimates the Residual's arrival from `residual_bytes_expected`:
    with the bound instead (2.3x BF16-coded sizes) it waited for a Residual ~2x too long."""
    src = _pool(0)
    src = KVPoolView([t.to(dtype) for t in src.k], [t.to(dtype) for t in src.v])
    spec = CodecSpec(target=target)
    _, residual = _streams(src, torch.arange(500), spec, 256, tag=3)
    plan = StreamPlan.build(spec, src.shape, 500, 256)
    if target == "int8":
        assert len(residual) == plan.residual_bytes_expected == plan.residual_bytes
    else:
        assert plan.residual_bytes_expected < plan.residual_bytes
        assert 0.85 < len(residual) / plan.residual_bytes_expected < 1.15


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("target", ["exact", "int8"])
def test_encode_into_staging_writes_the_same_streams(target, one_pass, executor):
    """What the prefill writes straight into staging with the fused codec, every layer's Anchor
    (alone, or with its Residual in one pass) and then every layer's Residual back to back, is
    byte for byte the streams of the torch reference."""
    spec = CodecSpec(target=target, sink_tokens=4, recent_tokens=16, rotate=True)
    src = _pool(0)
    slots = torch.randperm(SLOTS)[:345]
    anchor, residual = _streams(src, slots, spec, 128, tag=11)
    plan = StreamPlan.build(spec, src.shape, len(slots), 128)
    a_layer, r_layer = plan.anchor_layer_bytes, plan.residual_layer_bytes
    staging = np.zeros(plan.staging_bytes, dtype=np.uint8)
    one_pass_residual = []
    for layer in range(LAYERS):
        at = plan.anchor_offset(layer)
        r_at = plan.anchor_bytes + layer * r_layer
        written, r_written = encode_layer_into(
            src, layer, slots, spec, 128, 11, staging[at: at + a_layer],
            staging[r_at: r_at + r_layer] if one_pass else None, executor)
        assert written == a_layer
        one_pass_residual.append(staging[r_at: r_at + r_written].tobytes())
        assert one_pass or r_written == 0
    assert staging[:plan.anchor_bytes].tobytes() == anchor
    if one_pass:
        assert b"".join(one_pass_residual) == residual
        return
    scratch = np.zeros(a_layer, dtype=np.uint8)
    r_off = plan.anchor_bytes
    for layer in range(LAYERS):
        _, written = encode_layer_into(src, layer, slots, spec, 128, 11, scratch,
                                       staging[r_off: r_off + r_layer], executor)
        assert written <= r_layer
        r_off += written
    assert staging[plan.anchor_bytes:r_off].tobytes() == residual


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_residual_straight_after_parsing(target):
    """When both streams have landed the decode skips the Anchor write: parse + residual alone
    must give the same full-precision slots."""
    spec = CodecSpec(target=target)
    src, dst = _pool(0), _pool(1)
    slots = torch.arange(300)
    anchor, residual = _streams(src, slots, spec, 256, tag=5)
    anchors = apply_anchor(memoryview(anchor), dst, slots, spec, request_tag=5, write=False)
    apply_residual(memoryview(residual), anchors, dst, slots, spec, request_tag=5)
    for layer in range(LAYERS):
        full = decode(encode(src.v[layer][slots], spec, "v"), "full")
        assert torch.equal(dst.v[layer][slots], full)


def test_mismatches_are_refused():
    spec = CodecSpec(target="exact")
    src, dst = _pool(0), _pool(1)
    slots = torch.arange(100)
    anchor, residual = _streams(src, slots, spec, CHUNK, tag=3)
    before = dst.k[0].clone()
    with pytest.raises(KVStreamError, match="settings"):
        apply_anchor(memoryview(anchor), dst, slots, CodecSpec(target="int8"), request_tag=3)
    with pytest.raises(KVStreamError, match="tag 3"):
        apply_anchor(memoryview(anchor), dst, slots, spec, request_tag=4)
    assert torch.equal(dst.k[0], before), "a refused Anchor wrote into the pool"
    with pytest.raises(KVStreamError, match="B, the plan says"):
        apply_anchor(memoryview(anchor), dst, slots[:50], spec, request_tag=3)
    corrupt = bytearray(anchor)
    corrupt[len(corrupt) // 2] ^= 0xFF
    with pytest.raises(KVStreamError, match=r"checksum|CRC"):
        apply_anchor(memoryview(bytes(corrupt)), dst, slots, spec, request_tag=3)
    anchors = apply_anchor(memoryview(anchor), dst, slots, spec, request_tag=3)
    # A Residual that has only partly landed writes only its complete layers.
    half = len(residual) // 2
    assert apply_residual(memoryview(residual), anchors, dst, slots, spec, request_tag=3,
                          landed=half) == LAYERS // 2
    per_layer = [_reference_layer(src, layer, slots, spec, CHUNK, 3)[1] for layer in range(LAYERS)]
    swapped = per_layer[1] + per_layer[0] + b"".join(per_layer[2:])
    with pytest.raises(KVStreamError, match="layer 1 kind 0 while layer 0 K"):
        apply_residual(memoryview(swapped), anchors, dst, slots, spec, request_tag=3)


@pytest.mark.parametrize("bad", ["k", "v"])
def test_a_bad_run_on_two_threads_fails_after_both_kinds_ended(bad):
    """With the apply helper, a corrupt K or V Residual run raises naming its kind, and only once
    the other kind's call has ended: the applier may then free the room's staging and slots."""
    spec = CodecSpec(target="exact")
    src, dst = _pool(0), _pool(1)
    slots = torch.arange(300)
    anchor, _ = _streams(src, slots, spec, CHUNK, tag=5)
    anchors = apply_anchor(memoryview(anchor), dst, slots, spec, request_tag=5, write=False)
    k_res = b"".join(to_chunks(encode(src.read(0, KINDS[0], slots), spec, "k", layer=0), CHUNK,
                               stream="residual", request_tag=5))
    layer0 = bytearray(_reference_layer(src, 0, slots, spec, CHUNK, 5)[1])
    at = len(k_res) // 2 if bad == "k" else len(k_res) + (len(layer0) - len(k_res)) // 2
    layer0[at] ^= 0xFF
    runs = ResidualReader(LAYERS, len(slots)).advance(memoryview(bytes(layer0)), len(layer0))
    assert [layer for layer, _ in runs] == [0]
    good = "v" if bad == "k" else "k"
    with ThreadPoolExecutor(1) as executor:
        with pytest.raises(KVStreamError, match=f"the Residual {bad.upper()} of layer 0"):
            apply_full_layer(anchors[0], runs[0][1], dst, 0, slots, spec, 5, executor)
        # Read at once: the other kind's values are already all in.
        written = (dst.v if good == "v" else dst.k)[0][slots]
        assert torch.equal(written, (src.v if good == "v" else src.k)[0][slots])


def test_an_encode_that_fails_on_k_ends_after_v_has_written():
    """With the encode helper, K failing (a NaN in its pool) while V is still being encoded on
    the helper thread raises only once V's call has ended: the writer may then give the room's
    staging back, and no byte of V lands in it afterwards."""
    spec = CodecSpec(target="exact")
    src = _pool(0)
    slots = torch.arange(300)
    src.k[0][slots[7], 0, 3] = float("nan")
    sizes = fused.run_nbytes(spec, "k", src.k[0].dtype, *src.k[0].shape[1:], len(slots), CHUNK)
    anchor = np.zeros(2 * sizes.anchor, np.uint8)
    residual = np.zeros(2 * sizes.residual_bound, np.uint8)
    v_calls = []

    class SlowHelper(ThreadPoolExecutor):
        """V's call starts 0.3 s late, long after K has failed."""

        def submit(self, fn, *args):
            def late():
                time.sleep(0.3)
                try:
                    return fn(*args)
                finally:
                    v_calls.append(time.monotonic())
            return super().submit(late)

    with SlowHelper(1) as helper:
        with pytest.raises(KVStreamError, match=r"encoding layer 0: .*NaN"):
            encode_layer_into(src, 0, slots, spec, CHUNK, 9, anchor, residual, helper)
        raised = time.monotonic()
    assert len(v_calls) == 1 and v_calls[0] <= raised, "raised while V was still encoding"


def test_a_layer_whose_k_copies_fail_finishes_after_v_has_written():
    """A CUDA layer's K copies that never land (`finish` times out) while V is still being
    written on the helper thread: the layer's `finish` raises only once V's call has ended, so
    the writer that gives the room's staging back on that error leaves no V byte landing in it.
    Stand-ins for the runs: no GPU here."""
    class NeverLanded:
        def finish(self, timeout_s=None):
            raise TimeoutError("the device-to-host copy of encoded chunks did not complete")

    v_ended = []

    def v_run():
        time.sleep(0.3)
        v_ended.append(time.monotonic())
        return SimpleNamespace(finish=lambda timeout_s=None: (10, 20))

    with ThreadPoolExecutor(1) as helper:
        layer = PendingLayer(3, [NeverLanded(), helper.submit(v_run)], None, 0, True)
        with pytest.raises(KVStreamError, match="encoding layer 3: the device-to-host copy"):
            layer.finish(5.0)
        raised = time.monotonic()
    assert len(v_ended) == 1 and v_ended[0] <= raised, "raised while V was still being written"


def test_pool_view_refuses_other_pools():
    class Paged:
        page_size = 8  # not one of pages.SUPPORTED_PAGE_SIZES
        k_buffer = v_buffer = (torch.zeros(1, 1, 8),)

    with pytest.raises(KVStreamError, match="page-size"):
        KVPoolView.from_sglang_pool(Paged())
    Paged.page_size = 16
    assert KVPoolView.from_sglang_pool(Paged()).page_size == 16
    with pytest.raises(KVStreamError, match="MHA"):
        KVPoolView.from_sglang_pool(object())


def test_aux_round_trip():
    items = [b"\x01\x02", b"", bytes(range(256))]
    assert unpack_aux(pack_aux(items)) == list(enumerate(items))
    with pytest.raises(KVStreamError, match="truncated"):
        unpack_aux(pack_aux(items)[:-1])
