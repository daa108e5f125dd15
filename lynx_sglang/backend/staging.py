"""Registered staging memory for the Lynx KV streams: one buffer per KV manager, registered once
with the transport endpoint, handed out to requests as byte ranges.

Prefill: a request's encoded Anchor and Residual chunks are copied into its range and sent from
there; the range is freed once the transport reports both streams COMPLETE (or failed) and the
request has been released. Decode: a request's range is announced to the prefill as the
destination of both streams; it is freed after the Residual has been applied to the KV pool (or
the request failed) and the request has been released, so no late byte can land in a reused range.

With a CUDA KV pool the buffer is page-locked (`pinned`), so that the codec's device-to-host
copies of encoded chunks (`lynx_kernels.chunk_copy`) run as DMA beside the next layer's encode;
where page-locking fails the pool falls back to pageable memory and says so (the copies are then
synchronous, the bytes the same).

Created by `backend.manager.LynxKVManager`, used by its `PrefillSender` or `DecodeApplier`;
thread-safe. Allocation is first-fit with coalescing. `try_allocate` never waits: it returns None
when no free range is large enough, and raises `StagingFullError` for a request larger than the
whole pool; who needs space waits with `wait_for_free` (the prefill, up to the transfer timeout) or
queues (the decode, `DecodeApplier`).
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import StagingFullError
from ..metrics import Metrics

logger = logging.getLogger(__name__)

ALIGN = 64


@dataclass(frozen=True)
class StagingRange:
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class StagingPool:
    def __init__(self, nbytes: int, metrics: Metrics, pinned: bool = False):
        """`pinned`: page-lock the buffer (for a CUDA KV pool), if this process can."""
        if nbytes <= 0:
            raise ValueError(f"staging size must be positive, got {nbytes}")
        self._metrics = metrics  # the process's: the staging memory in use
        self.buffer = np.empty(nbytes, dtype=np.uint8)
        self.nbytes = nbytes
        self.pinned = pinned and self._page_lock()
        # Sorted, non-overlapping, coalesced free ranges as (offset, length).
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        # Ranges handed out and not yet freed, by offset: a second free of one (a bug that would
        # hand the same bytes to two requests) is refused.
        self._allocated: dict[int, int] = {}
        self._cond = threading.Condition()
        # Published from the start, so a leak check reads 0 on a server that has sent nothing yet.
        self._metrics.record_staging_used(0)

    def _page_lock(self) -> bool:
        """Page-lock the buffer for CUDA's copies (cudaHostRegister: exactly these bytes, where
        torch's pinned allocator rounds a block up to a power of two); False, logged, where this
        process cannot (no CUDA, or the driver refuses: the copies then are synchronous)."""
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(self.buffer.ctypes.data,
                                                            self.nbytes, 1))  # portable
            why = None if err == 0 else f"cudaHostRegister returned cudaError {err}"
        except (AssertionError, RuntimeError) as exc:  # a torch without CUDA, no device
            why = str(exc)
        if why is not None:
            logger.warning("lynx: staging: could not page-lock %d MiB (%s); using pageable memory: "
                           "the device-to-host copies of encoded chunks are then synchronous",
                           self.nbytes >> 20, why)
        return why is None

    def view(self, r: StagingRange) -> memoryview:
        return memoryview(self.buffer)[r.offset: r.end]

    def try_allocate(self, length: int) -> StagingRange | None:
        """A range now, or None if no free range is large enough."""
        size = self._size(length)
        with self._cond:
            return self._take_locked(size)

    def wait_for_free(self, timeout_s: float) -> None:
        """Wait until a range is freed, or `timeout_s` passed."""
        with self._cond:
            self._cond.wait(timeout_s)

    def holds(self, length: int) -> bool:
        """Whether a range of `length` B fits the whole pool, as allocated (rounded up)."""
        return -(-length // ALIGN) * ALIGN <= self.nbytes

    def _size(self, length: int) -> int:
        if length <= 0:
            raise ValueError(f"allocation length must be positive, got {length}")
        size = -(-length // ALIGN) * ALIGN
        if not self.holds(length):
            raise StagingFullError(
                f"a request needs {length} B of staging, more than the whole pool ({self.nbytes} B);"
                " raise --lynx-staging-mib"
            )
        return size

    def _take_locked(self, size: int) -> StagingRange | None:
        for i, (off, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, n - size)
                self._allocated[off] = size
                self._metrics.record_staging_used(self.nbytes - self._free_locked())
                return StagingRange(off, size)
        return None

    def free(self, r: StagingRange) -> None:
        with self._cond:
            if self._allocated.get(r.offset) != r.length:
                raise ValueError(f"staging range {r} is not allocated (freed twice?)")
            del self._allocated[r.offset]
            i = bisect.bisect_left(self._free, (r.offset, 0))
            self._free.insert(i, (r.offset, r.length))
            # Coalesce with the neighbours.
            merged: list[tuple[int, int]] = []
            for off, n in self._free[max(0, i - 1): i + 2]:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free[max(0, i - 1): i + 2] = merged
            self._metrics.record_staging_used(self.nbytes - self._free_locked())
            self._cond.notify_all()

    def free_bytes(self) -> int:
        with self._cond:
            return self._free_locked()

    def _free_locked(self) -> int:
        return sum(n for _, n in self._free)

    def used_bytes(self) -> int:
        return self.nbytes - self.free_bytes()
