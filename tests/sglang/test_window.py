"""lynx_sglang.backend.window: how a room larger than staging is cut into segments and windows, and
how the prefill checks the segments a decode announces (untrusted input)."""

from __future__ import annotations

import json

import pytest

from lynx_kernels import CodecSpec, preset
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.staging import ALIGN
from lynx_sglang.backend.window import SEGMENT_IDS, Segments, choose, cut
from lynx_sglang.errors import KVStreamError, StagingFullError

SHAPE = preset("SmolLM2-135M")  # 30 layers


def _plan(tokens: int) -> StreamPlan:
    return StreamPlan.build(CodecSpec(), SHAPE, tokens, 256)


def _layer_bytes(plan: StreamPlan) -> int:
    return plan.anchor_layer_bytes + plan.residual_layer_bytes


@pytest.mark.parametrize("tokens,pool_mib,count,fraction", [
    (8000, 64, 2, 4),   # a layer fits a quarter: two windows, half the pool
    (8000, 24, 2, 2),   # only half: two windows of half
    (8000, 12, 1, 1),   # only the whole pool: one window
])
def test_windows_hold_whole_layers_and_leave_room(tokens, pool_mib, count, fraction):
    plan, pool = _plan(tokens), pool_mib << 20
    assert plan.staging_bytes > pool
    w = choose(plan, pool, ALIGN)
    assert (w.count, w.nbytes % ALIGN) == (count, 0)
    assert w.layers_per_segment * _layer_bytes(plan) <= w.nbytes <= pool // fraction
    # The largest whole number of layers that fits the chosen window size.
    assert (w.layers_per_segment + 1) * _layer_bytes(plan) > pool // fraction // ALIGN * ALIGN
    assert w.staging_bytes <= pool


def test_a_layer_larger_than_the_pool_fails_at_once():
    plan = _plan(8000)
    with pytest.raises(StagingFullError, match="one layer of this request needs"):
        choose(plan, _layer_bytes(plan) - 1, ALIGN)


def test_segments_tile_the_layers_and_their_plans_add_up():
    plan = _plan(8000)
    seg = cut(plan.num_layers, 7, SEGMENT_IDS.start + 10)
    assert seg.bounds == (0, 7, 14, 21, 28, 30) and seg.count == 5
    assert [seg.request_id(42, j) for j in range(seg.count)] == [
        42, *range(SEGMENT_IDS.start + 10, SEGMENT_IDS.start + 14)]
    plans = [seg.plan(plan, j) for j in range(seg.count)]
    assert sum(p.anchor_bytes for p in plans) == plan.anchor_bytes
    assert sum(p.residual_bytes for p in plans) == plan.residual_bytes
    assert plans[-1].num_layers == 2
    assert Segments.parse(seg.meta(), plan.num_layers) == seg


def test_no_meta_is_an_ordinary_room():
    assert Segments.parse(b"", 30) is None


@pytest.mark.parametrize("doc", [
    {"segments": [0, 10, 30]},                               # no first id
    {"segments": [0, 10, 20], "first_id": SEGMENT_IDS.start},  # does not reach the last layer
    {"segments": [1, 10, 30], "first_id": SEGMENT_IDS.start},  # does not start at 0
    {"segments": [0, 10, 10, 30], "first_id": SEGMENT_IDS.start},  # an empty segment
    {"segments": [0, 20, 10, 30], "first_id": SEGMENT_IDS.start},  # out of order
    {"segments": [0, 10.5, 30], "first_id": SEGMENT_IDS.start},  # not whole layers
    {"segments": [0, True, 30], "first_id": SEGMENT_IDS.start},
    {"segments": [*range(31), 31], "first_id": SEGMENT_IDS.start},  # past the layers
    {"segments": [0, 10, 30], "first_id": 7},                # an id SGLang's rooms may take
    {"segments": [0, 10, 20, 30], "first_id": SEGMENT_IDS.stop - 1},  # the 2nd id is the identity
    {"segments": "0,10,30", "first_id": SEGMENT_IDS.start},
])
def test_hostile_segments_are_refused(doc):
    with pytest.raises(KVStreamError):
        Segments.parse(json.dumps(doc).encode(), 30)


def test_malformed_meta_is_refused():
    with pytest.raises(KVStreamError, match="malformed"):
        Segments.parse(b"\xff{", 30)
