"""Pure-data pieces of lynx_transport: announcement geometry, policy validation, backend lookup."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lynx_transport import (
    Announcement,
    BackendUnavailableError,
    Extent,
    OutOfBoundsError,
    PriorityPolicy,
    Stream,
    load_backend,
)

pytestmark = pytest.mark.timeout(60)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6), st.data())
def test_locate_covers_range_in_order(lengths, data):
    exts, pos = [], 0
    for i, n in enumerate(lengths):
        exts.append(Extent(i % 2, 1000 * i + 7, n))
        pos += n
    ann = Announcement(1, {Stream.ANCHOR: tuple(exts)})
    total = ann.stream_nbytes(Stream.ANCHOR)
    off = data.draw(st.integers(0, total))
    length = data.draw(st.integers(0, total - off))
    pieces = ann.locate(Stream.ANCHOR, off, length)
    assert sum(e.length for e, _ in pieces) == length
    rel = 0
    for ext, r in pieces:
        assert r == rel and ext.length > 0
        assert ann.contains(Stream.ANCHOR, ext.region_id, ext.offset, ext.length)
        rel += ext.length
    with pytest.raises(OutOfBoundsError):
        ann.locate(Stream.ANCHOR, off, total - off + 1)


def test_contains_needs_one_extent_and_the_right_stream():
    ann = Announcement(1, {Stream.ANCHOR: (Extent(1, 0, 10), Extent(1, 10, 10)),
                           Stream.RESIDUAL: (Extent(2, 0, 5),)})
    assert ann.contains(Stream.ANCHOR, 1, 0, 10)
    assert not ann.contains(Stream.ANCHOR, 1, 5, 10)  # spans two extents: one write, one extent
    assert not ann.contains(Stream.ANCHOR, 2, 0, 1)
    assert not ann.contains(Stream.RESIDUAL, 2, 1, 5)
    with pytest.raises(ValueError):
        Extent(1, -1, 3)


def test_policy_and_backend_validation():
    with pytest.raises(ValueError):
        PriorityPolicy(mode="fifo")
    with pytest.raises(ValueError):
        PriorityPolicy(mode="weighted", residual_share=1.0)
    with pytest.raises(ValueError):
        PriorityPolicy(chunk_bytes=100)
    with pytest.raises(BackendUnavailableError, match="unknown transport backend"):
        load_backend("carrier-pigeon")
    assert load_backend("tcp").name == "tcp"


def test_bad_endpoint_inputs_are_clear_errors():
    import numpy as np

    from lynx_transport import Endpoint, RegionError

    with pytest.raises(ValueError, match="unknown tcp backend options"):
        Endpoint(backend_options={"bogus": 1})
    with Endpoint() as ep:
        with pytest.raises(RegionError, match="contiguous"):
            ep.register(np.zeros((8, 8), np.uint8)[:, ::2])
        with pytest.raises(RegionError, match="length"):
            ep.register(12345)
        ro = ep.register(b"read-only bytes")
        assert not ro.writable
        with pytest.raises(RegionError, match="not registered"):
            ep.deregister(999)
