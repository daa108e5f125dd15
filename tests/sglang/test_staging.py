"""lynx_sglang.backend.staging.StagingPool: first-fit allocation, coalescing, deadlines."""

from __future__ import annotations

import threading
import time

import pytest

from lynx_sglang.backend.staging import ALIGN, StagingPool
from lynx_sglang.errors import StagingFullError


def test_allocate_free_coalesce():
    pool = StagingPool(10 * ALIGN)
    a = pool.allocate(ALIGN, 0)
    b = pool.allocate(3 * ALIGN - 5, 0)
    c = pool.allocate(ALIGN, 0)
    assert (a.offset, b.offset, c.offset) == (0, ALIGN, 4 * ALIGN)
    assert b.length == 3 * ALIGN
    pool.free(b)
    pool.free(a)
    # a and b coalesced: a 4-ALIGN request fits at 0 again.
    assert pool.allocate(4 * ALIGN, 0).offset == 0
    pool.free(c)
    assert pool.free_bytes() == 6 * ALIGN


def test_full_pool_fails_after_deadline_or_waits_for_free():
    pool = StagingPool(4 * ALIGN)
    a = pool.allocate(4 * ALIGN, 0)
    t0 = time.monotonic()
    with pytest.raises(StagingFullError, match="no 64 B"):
        pool.allocate(1, 0.2)
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, pool.free, args=(a,)).start()
    assert pool.allocate(ALIGN, 5.0).offset == 0
    with pytest.raises(StagingFullError, match="more than the whole pool"):
        pool.allocate(5 * ALIGN, 0)


def test_a_range_cannot_be_freed_twice():
    pool = StagingPool(4 * ALIGN)
    a = pool.allocate(ALIGN, 0)
    pool.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(type(a)(ALIGN, ALIGN))
    assert pool.free_bytes() == 4 * ALIGN and pool.used_bytes() == 0
