"""The stand-in for SGLang's scheduler that lynx_sglang.speculation.verify (`_bonus_slots`,
`rollback`) is handed in unit tests, where the real one would need a running SGLang: only what
those read, its `token_to_kv_pool_allocator` (the test's own allocator), the request rows
`req_to_token_pool.req_to_token` and a `tree_cache` that records the ranges it is asked to free.
Used by test_speculation_bookkeeping.py (page size 1) and test_paged_kv.py (a paged allocator).
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


class StandinScheduler:
    def __init__(self, allocator, dtype: torch.dtype):
        self.token_to_kv_pool_allocator = allocator
        # SGLang's ReqToTokenPool: one row of KV slots per request (req.kv.req_pool_idx), here two
        # requests of up to 64 positions; SGLang's own rows are int32.
        self.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(2, 64, dtype=dtype))
        self.tree_cache = RecordingTreeCache()
