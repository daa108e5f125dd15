"""Page arithmetic of `--page-size` > 1 (lynx_sglang.backend.pages) and the speculative decode's
page-granular bonus slot and rollback (lynx_sglang.speculation.verify), on stand-in scheduler
objects; tests/sglang/test_pd_lynx_paged.py runs them end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from standin_scheduler import StandinAllocator, StandinKV, StandinReq, StandinScheduler

from lynx_sglang.backend.pages import num_pages, page_ceil, token_slots
from lynx_sglang.errors import KVStreamError
from lynx_sglang.speculation.acceptance import Acceptance
from lynx_sglang.speculation.state import SpecState
from lynx_sglang.speculation.verify import _bonus_slots, apply_acceptance, rollback

PAGE = 4


def test_page_counts_and_boundaries():
    assert [num_pages(n, PAGE) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert [page_ceil(n, PAGE) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [page_ceil(n, 1) for n in (0, 5)] == [0, 5]


def test_token_slots_invert_sglangs_page_indices_with_a_partial_last_page():
    # A request's row as SGLang's paged allocator fills it: position i in page i // P.
    pages = np.array([5, 2, 9])
    row = (pages[:, None] * PAGE + np.arange(PAGE)).reshape(-1)[:10]
    # sglang.srt.mem_cache.common.kv_to_page_indices
    handed = row[::PAGE] // PAGE
    assert np.array_equal(token_slots(handed, PAGE, 10), row)
    # Page size 1: the indices are the slots, taken as they are.
    assert token_slots(row, 1, None) is row


def test_token_slots_refuse_pages_that_do_not_fit_the_length():
    with pytest.raises(KVStreamError, match="3 KV pages of 4 tokens"):
        token_slots([1, 2, 3], PAGE, 8)
    with pytest.raises(KVStreamError):
        token_slots([1, 2], PAGE, 9)
    with pytest.raises(KVStreamError, match="without the number of tokens"):
        token_slots([1, 2], PAGE, None)


def _scheduler(free_pages: list[int]) -> StandinScheduler:
    return StandinScheduler(StandinAllocator(free_pages, PAGE), torch.int64)


def _req(sched: StandinScheduler, prompt: int, n_spec: int, row: int, first_page: int) -> StandinReq:
    """Prompt + t0..s(n-1) hold KV in consecutive pages from `first_page`."""
    held = prompt + n_spec
    pages = range(first_page, first_page + num_pages(held, PAGE))
    slots = token_slots(list(pages), PAGE, held)
    sched.req_to_token_pool.req_to_token[row, :held] = torch.as_tensor(slots)
    return StandinReq(list(range(prompt)), [1] + [10 + i for i in range(n_spec)],
                      StandinKV(held, held, row))


def test_bonus_inside_the_last_page_takes_its_next_slot_without_allocating():
    sched = _scheduler([])
    req = _req(sched, prompt=10, n_spec=3, row=0, first_page=20)  # 13 held: page 23 partial
    assert _bonus_slots(sched, [req], [True]) == [1]
    assert int(sched.req_to_token_pool.req_to_token[0, 13]) == 23 * PAGE + 1
    assert req.kv.kv_allocated_len == 14


def test_bonus_at_a_page_boundary_takes_a_new_page_or_none_for_anyone():
    sched = _scheduler([7])
    at_boundary = _req(sched, prompt=10, n_spec=2, row=0, first_page=20)  # 12 held
    inside = _req(sched, prompt=10, n_spec=1, row=1, first_page=30)  # 11 held
    assert _bonus_slots(sched, [at_boundary, inside], [True, True]) == [1, 1]
    r2t = sched.req_to_token_pool.req_to_token
    assert (int(r2t[0, 12]), int(r2t[1, 11])) == (7 * PAGE, 32 * PAGE + 3)
    # No free page: a request at a boundary gets none, and then neither does anyone.
    sched2 = _scheduler([])
    a = _req(sched2, prompt=10, n_spec=2, row=0, first_page=20)
    b = _req(sched2, prompt=10, n_spec=1, row=1, first_page=30)
    assert _bonus_slots(sched2, [a, b], [True, True]) == [0, 0]
    assert (a.kv.kv_allocated_len, b.kv.kv_allocated_len) == (12, 11)


def test_rollback_frees_only_whole_pages_past_the_kept_positions():
    sched = _scheduler([])
    req, st = _req(sched, prompt=10, n_spec=8, row=0, first_page=20), SpecState(room=1)  # 18
    rollback(sched, req, st.verified_len, apply_acceptance(req, st, Acceptance(1, 99)))
    # Kept: prompt + t0, s1 = 12 positions, a page boundary: positions 12..17 go (pages 23, 24).
    assert sched.tree_cache.freed == [[(12, 18)]]
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 12

    sched = _scheduler([])
    req, st = _req(sched, prompt=10, n_spec=8, row=0, first_page=20), SpecState(room=1)
    rollback(sched, req, st.verified_len, apply_acceptance(req, st, Acceptance(2, 99)))
    # Kept 13: page 23 (positions 12..15) still holds position 12, so only page 24 goes; the
    # next decode step writes position 13 into page 23's next slot.
    assert sched.tree_cache.freed == [[(16, 18)]]
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 13

    sched = _scheduler([])
    req, st = _req(sched, prompt=10, n_spec=4, row=0, first_page=20), SpecState(room=1)  # 14
    rollback(sched, req, st.verified_len, apply_acceptance(req, st, Acceptance(2, 99)))
    assert sched.tree_cache.freed == []  # 13 kept, 14 held: both in page 23
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 13
