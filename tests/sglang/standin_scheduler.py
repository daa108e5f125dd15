"""The stand-ins for SGLang's scheduler and requests that lynx_sglang.speculation.verify
(`_bonus_slots`, `rollback`, `apply_acceptance`) is handed in unit tests, where the real ones would
need a running SGLang: only what those read. The scheduler's `token_to_kv_pool_allocator`
(`StandinAllocator`, pages of any size), the request rows `req_to_token_pool.req_to_token` and a
`tree_cache` that records the ranges it is asked to free; a request's ids and its KV bookkeeping
(`StandinReq`, `StandinKV`). Used by test_speculation_bookkeeping.py (page size 1) and
test_paged_kv.py (pages of 4 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch


@dataclass
class RecordingTreeCache:
    """SGLang's tree cache as far as freeing KV goes: `freed` lists each call's ranges."""

    freed: list = field(default_factory=list)

    def free_kv_row(self, kv, ranges):
        self.freed.append(list(ranges))


@dataclass
class StandinAllocator:
    """SGLang's KV slot allocator: `alloc(n)` hands out the slots of whole pages taken from
    `free_pages` (page p holds slots p * page_size ...), or None when too few are left. With page
    size 1 a page is a slot."""

    free_pages: list[int]
    page_size: int = 1

    def alloc(self, n: int):
        assert n % self.page_size == 0  # SGLang's paged allocator hands whole pages
        k = n // self.page_size
        if k > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:k], self.free_pages[k:]
        return (torch.tensor(out, dtype=torch.int64)[:, None] * self.page_size
                + torch.arange(self.page_size)).reshape(-1)


class StandinScheduler:
    def __init__(self, allocator, dtype: torch.dtype):
        self.token_to_kv_pool_allocator = allocator
        # SGLang's ReqToTokenPool: one row of KV slots per request (req.kv.req_pool_idx), here two
        # requests of up to 64 positions; SGLang's own rows are int32.
        self.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(2, 64, dtype=dtype))
        self.tree_cache = RecordingTreeCache()


@dataclass
class StandinKV:
    """A request's KV bookkeeping (`req.kv`): positions with a slot, positions kept, its row."""

    kv_allocated_len: int
    kv_committed_len: int
    req_pool_idx: int = 0


@dataclass
class StandinReq:
    origin_input_ids: list[int]
    output_ids: list[int]
    kv: StandinKV
