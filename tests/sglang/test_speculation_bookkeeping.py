"""Rollback bookkeeping of lynx_sglang.speculation on stand-in request / tree-cache objects (the
real SGLang objects need a running scheduler; tests/sglang/test_pd_lynx_spec.py covers them end to
end): which output ids survive an acceptance decision and which KV row positions are freed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from standin_scheduler import StandinAllocator, StandinKV, StandinReq, StandinScheduler

from lynx_sglang.speculation.acceptance import Acceptance
from lynx_sglang.speculation.state import SpecState
from lynx_sglang.speculation.verify import _bonus_slots, apply_acceptance, rollback

PROMPT = list(range(100, 110))  # P = 10


def _speculated_req(n_spec: int, row: int = 0) -> StandinReq:
    # output_ids = [t0, s1..sn]; KV exists for the prompt and t0..s(n-1): P + n positions.
    out = [1] + [10 + i for i in range(n_spec)]
    return StandinReq(list(PROMPT), out, StandinKV(len(PROMPT) + n_spec, len(PROMPT) + n_spec, row))


def test_rejection_keeps_prefix_appends_correction_and_frees_the_rest():
    req, sched, st = _speculated_req(6), _scheduler(), SpecState(room=1)
    result = apply_acceptance(req, st, Acceptance(2, 99))
    rollback(sched, req, st.verified_len, result)
    assert req.output_ids == [1, 10, 11, 99]
    assert (result.speculated, result.accepted, result.corrected_token) == (6, 2, 99)
    # KV kept for the prompt + t0, s1, s2 (inputs of the verified positions); the next decode
    # step feeds the correction at position P + 3.
    assert sched.tree_cache.freed == [[(13, 16)]]
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 13


def test_full_acceptance_changes_nothing():
    req, sched, st = _speculated_req(4), _scheduler(), SpecState(room=1)
    result = apply_acceptance(req, st, Acceptance(4, None))
    rollback(sched, req, st.verified_len, result)
    assert req.output_ids == [1, 10, 11, 12, 13]
    assert sched.tree_cache.freed == []
    assert req.kv.kv_committed_len == 14


def test_rejecting_the_first_draft_keeps_only_the_prefill_token():
    req, sched, st = _speculated_req(3), _scheduler(), SpecState(room=1)
    rollback(sched, req, st.verified_len, apply_acceptance(req, st, Acceptance(0, 7)))
    assert req.output_ids == [1, 7]
    assert sched.tree_cache.freed == [[(11, 13)]]
    assert req.kv.kv_committed_len == 11


def _scheduler(free: list[int] | None = None) -> StandinScheduler:
    return StandinScheduler(StandinAllocator(free or []), torch.int32)


def test_bonus_slot_then_full_acceptance_keeps_the_bonus_token_and_its_input_kv():
    sched = _scheduler([77, 78])
    req, st = _speculated_req(4, row=1), SpecState(room=1)
    assert _bonus_slots(sched, [req], [True]) == [1]
    # Position P + n = 14 (the input of the last draft) now has a slot: the verification
    # forward feeds s4 there, and its last row predicts the bonus token.
    assert int(sched.req_to_token_pool.req_to_token[1, 14]) == 77
    assert req.kv.kv_allocated_len == 15
    result = apply_acceptance(req, st, Acceptance(4, 55))
    rollback(sched, req, st.verified_len, result)
    assert req.output_ids == [1, 10, 11, 12, 13, 55]
    assert (result.corrected_token, result.bonus_token) == (None, 55)
    assert sched.tree_cache.freed == []
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 15


def test_bonus_slot_is_freed_with_the_rejected_positions():
    sched = _scheduler([77])
    req, st = _speculated_req(4, row=0), SpecState(room=1)
    assert _bonus_slots(sched, [req], [True]) == [1]
    result = apply_acceptance(req, st, Acceptance(1, 99))
    rollback(sched, req, st.verified_len, result)
    assert req.output_ids == [1, 10, 99]
    assert (result.corrected_token, result.bonus_token) == (99, None)
    assert sched.tree_cache.freed == [[(12, 15)]]
    assert req.kv.kv_allocated_len == req.kv.kv_committed_len == 12


def test_no_bonus_without_free_slots_or_when_not_asked():
    sched = _scheduler([77])
    a, b = _speculated_req(2, row=0), _speculated_req(3, row=1)
    assert _bonus_slots(sched, [a, b], [True, True]) == [0, 0]  # one slot for two: none
    assert _bonus_slots(sched, [a, b], [False, True]) == [0, 1]
    assert (a.kv.kv_allocated_len, b.kv.kv_allocated_len) == (12, 14)


THINK_END = 7


@dataclass
class _ReasoningReq:
    output_ids: list[int]
    reasoning_tokens: int = 0
    _is_reasoning_over: bool = False
    _think_end_match_len: int = 0
    _think_start_match_len: int = 0
    _think_end_matcher: object = None


@dataclass
class _Processor:
    """SGLang's batch-result processor as far as reasoning accounting goes: every token up to and
    including the think-end token counts (a one-token terminator, so no partial match state)."""

    def _maybe_update_reasoning_tokens(self, req, token_ids):
        for tok in token_ids if isinstance(token_ids, list) else [token_ids]:
            if req._is_reasoning_over:
                return
            req.reasoning_tokens += 1
            req._is_reasoning_over = tok == THINK_END


def test_rolled_back_tokens_leave_the_reasoning_count(standin_release):
    from lynx_sglang.speculation.verify import recount_reasoning

    proc = _Processor()
    req = _ReasoningReq([1])
    proc._maybe_update_reasoning_tokens(req, [1])  # the first token, counted at commit
    st = SpecState(room=1,
                   reasoning=tuple(getattr(req, a) for a in standin_release.reasoning_state))
    for tok in (5, THINK_END, 8):  # speculative decode steps: reasoning ends at the 2nd
        req.output_ids.append(tok)
        proc._maybe_update_reasoning_tokens(req, tok)
    assert (req.reasoning_tokens, req._is_reasoning_over) == (3, True)
    # Verification rejects every speculative token and corrects the first to 6.
    apply_acceptance(req, st, Acceptance(0, 6))
    recount_reasoning(_SchedulerWithProcessor(proc), req, st)
    assert req.output_ids == [1, 6]
    assert (req.reasoning_tokens, req._is_reasoning_over) == (2, False)


@dataclass
class _SchedulerWithProcessor:
    batch_result_processor: _Processor
