"""lynx_sglang.backend.staging.StagingPool: first-fit allocation, coalescing, waiting for a free."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lynx_sglang.backend.staging import ALIGN, StagingPool
from lynx_sglang.errors import StagingFullError
from lynx_sglang.metrics import Metrics


def test_allocate_free_coalesce():
    pool = StagingPool(10 * ALIGN, Metrics())
    a = pool.try_allocate(ALIGN)
    b = pool.try_allocate(3 * ALIGN - 5)
    c = pool.try_allocate(ALIGN)
    assert (a.offset, b.offset, c.offset) == (0, ALIGN, 4 * ALIGN)
    assert b.length == 3 * ALIGN
    pool.free(b)
    pool.free(a)
    # a and b coalesced: a 4-ALIGN request fits at 0 again.
    assert pool.try_allocate(4 * ALIGN).offset == 0
    pool.free(c)
    assert pool.free_bytes() == 6 * ALIGN


def test_a_full_pool_gives_none_and_wakes_a_waiter_on_free():
    pool = StagingPool(4 * ALIGN, Metrics())
    a = pool.try_allocate(4 * ALIGN)
    assert pool.try_allocate(1) is None
    t0 = time.monotonic()
    pool.wait_for_free(0.2)  # nothing freed: the whole timeout
    assert time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, pool.free, args=(a,)).start()
    t0 = time.monotonic()
    pool.wait_for_free(5.0)
    assert time.monotonic() - t0 < 4.0
    assert pool.try_allocate(ALIGN).offset == 0
    with pytest.raises(StagingFullError, match="more than the whole pool"):
        pool.try_allocate(5 * ALIGN)


def test_a_range_cannot_be_freed_twice():
    pool = StagingPool(4 * ALIGN, Metrics())
    a = pool.try_allocate(ALIGN)
    pool.free(a)
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(type(a)(ALIGN, ALIGN))
    assert pool.free_bytes() == 4 * ALIGN and pool.used_bytes() == 0


def test_pinned_staging_is_page_locked_or_says_why_not(caplog):
    """A CUDA pool's staging is page-locked (the encoded chunks' device-to-host copies are DMA
    then); where this process cannot page-lock (this CPU-only torch), the pool falls back to
    pageable memory and logs why instead of failing the server."""
    pool = StagingPool(4 * ALIGN, Metrics(), pinned=True)
    if torch.cuda.is_available():
        assert pool.pinned and torch.from_numpy(pool.buffer).is_pinned()
    else:
        assert not pool.pinned
        assert "could not page-lock" in caplog.text and "pageable" in caplog.text
    pool.buffer[:] = 7  # usable either way
    assert pool.view(pool.try_allocate(ALIGN)).tobytes() == b"\x07" * ALIGN
    assert not StagingPool(ALIGN, Metrics()).pinned
