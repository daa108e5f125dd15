"""Decode staging between Lynx's prefill and decode KV managers with SGLang's own machinery in
one process (conn_pair.py): a room that finds the decode's staging full waits in a queue (its KV
indices held back from the prefill) and then succeeds exactly, or leaves the queue when aborted or
past the waiting budget, failing both sides at once; a room larger than the whole staging is sent
in segments through a window (`backend.window`) and arrives exact, Success only with the final
KV; the fault-injection holds (`lynx-sglang faults`) sit where they claim to (after a windowed
room's first segment, mid-Anchor); a windowed room dropped between segments frees the prefill's
worker at once.

The test marked `rdma_vm` runs over tcp on the host and over verbs inside the soft-RoCE guest
(conn_pair's LYNX_RDMA_VM / LYNX_RDMA_DEVICE), where each segment is one memory registration.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from conn_pair import (
    LAYERS,
    LONG_HOLD_S,
    NUM_TOKENS,
    PD,
    POOL_TOKENS,
    Request,
    SGLang,
    failure_message,
    forward_and_send,
    holds,
    make_cfg,
    open_request,
    poll_until_done,
    prefill_staging_free,
    release_holds_and_expect_full_kv,
    request_metadata,
    start_request,
    wait_for,
)

from lynx_sglang.backend.identity import IDENTITY_REQUEST
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.staging import ALIGN as STAGING_ALIGN
from lynx_sglang.names import FAULT_ANCHOR_HOLD_LOG, FAULT_RESIDUAL_HOLD_LOG
from lynx_transport import Stream

pytestmark = pytest.mark.sglang


def _fill_decode_staging(sgl: SGLang, pd: PD,
                         first_room: int) -> list[tuple[Request, torch.Generator]]:
    """As many rooms as the decode's staging holds at once, opened up to the prefill's `send`
    (their KV indices at the prefill, their ranges held), none sent yet."""
    staging = pd.decode.mgr.staging
    plan = StreamPlan.build(pd.decode.mgr.lynx.codec, pd.decode.mgr.pool.shape, NUM_TOKENS,
                            pd.decode.mgr.lynx.chunk_tokens)
    fit = staging.nbytes // (-(-plan.staging_bytes // STAGING_ALIGN) * STAGING_ALIGN)
    # One more room must still find free KV slots on both sides.
    assert fit >= 1 and (fit + 1) * NUM_TOKENS < POOL_TOKENS, fit
    holders: list[tuple[Request, torch.Generator]] = []
    for i in range(fit):
        holders.append(open_request(sgl, pd, room=first_room + i, seed=first_room + i,
                                     beside=tuple(r for r, _ in holders)))
    assert staging.try_allocate(plan.staging_bytes) is None  # full for one more room
    return holders


def _queued(pd: PD) -> int:
    return pd.decode.mgr.applier.tracked()["decode_rooms_awaiting_staging"]


def test_a_room_that_finds_decode_staging_full_waits_and_succeeds(sgl, make_pd):
    """Concurrency beyond the decode's staging queues a room instead of failing it: its KV indices
    are held back from the prefill until a range comes free (so the prefill does not start it),
    then it goes through like any other, exactly."""
    pd = make_pd(make_cfg(target="exact", staging_mib=1))
    holders = _fill_decode_staging(sgl, pd, first_room=8100)
    late, g = request_metadata(sgl, pd, room=8190, seed=90, beside=tuple(r for r, _ in holders))
    assert _queued(pd) == 1
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert late.receiver.poll() == sgl.KVPoll.WaitingForInput
        assert late.sender.poll() == sgl.KVPoll.Bootstrapping  # the prefill has no indices yet
        time.sleep(0.02)
    for req, rg in holders:
        forward_and_send(pd, req, rg)
    for req, _ in holders:
        assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    # The receiver's poll (SGLang's transfer queue polls it every step) sends the held indices.
    wait_for("the prefill to get the queued room's KV indices",
          lambda: (late.receiver.poll(), late.sender.poll())[1] == sgl.KVPoll.WaitingForInput)
    assert _queued(pd) == 0
    late.sender.init(NUM_TOKENS, late.prefill_aux)
    forward_and_send(pd, late, g)
    assert poll_until_done(sgl, late.receiver) == sgl.KVPoll.Success
    assert poll_until_done(sgl, late.sender) == sgl.KVPoll.Success
    for req in (*(r for r, _ in holders), late):
        assert holds(pd, req, "full"), req.room
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert pd.decode.mgr.applier.tracked()["decode_rooms"] == 0


def test_queued_rooms_leave_the_queue_when_aborted_or_past_the_waiting_budget(sgl, make_pd):
    """An aborted queued room gives its place up; one queued past the waiting budget fails on
    both sides at once, saying why; the rooms holding staging are untouched."""
    pd = make_pd(make_cfg(target="exact", staging_mib=1))
    # With the prefill's session open, the holders are announced under the budget they were
    # registered with: the shortened one below applies to the queued rooms only.
    warm = start_request(sgl, pd, room=8250, seed=93)
    assert poll_until_done(sgl, warm.receiver) == sgl.KVPoll.Success
    holders = _fill_decode_staging(sgl, pd, first_room=8200)
    # Never written to (they get no range), so their slots may overlap each other's.
    first, _ = request_metadata(sgl, pd, room=8290, seed=91, beside=tuple(r for r, _ in holders))
    second, _ = request_metadata(sgl, pd, room=8291, seed=92,
                                  beside=tuple(r for r, _ in holders))
    assert _queued(pd) == 2
    first.receiver.abort()
    assert first.receiver.poll() == sgl.KVPoll.Failed
    assert _queued(pd) == 1
    # The budget is SGLang's waiting timeout (300 s by default): shortened on the live applier.
    pd.decode.mgr.applier.admission.waiting_s = 0.3
    assert poll_until_done(sgl, second.receiver) == sgl.KVPoll.Failed
    msg = failure_message(sgl, second.receiver)
    assert "of staging came free within 0.3 s" in msg and "--lynx-staging-mib" in msg, msg
    # The prefill hears of it now, not after its own bootstrap timeout.
    assert poll_until_done(sgl, second.sender) == sgl.KVPoll.Failed
    assert _queued(pd) == 0
    pd.decode.mgr.applier.admission.waiting_s = 300.0
    for req, rg in holders:
        forward_and_send(pd, req, rg)
    for req, _ in holders:
        assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
        assert holds(pd, req, "full")
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert pd.decode.mgr.applier.tracked()["decode_rooms"] == 0


# More exact-target staging than 1 MiB in conn_pair's two layers, and still one layer per window.
WINDOWED_TOKENS = 1000


@pytest.mark.rdma_vm
def test_a_room_larger_than_decode_staging_is_sent_in_segments(sgl, make_pd, caplog):
    """A room whose staging exceeds the whole pool is windowed (`backend.window`): here two
    segments of one layer take turns in one window of the whole pool. The KV arrives exact,
    Success comes only with the final KV (a windowed room never speculates, speculation on or
    not), and every segment's announcement and range is given back. In the soft-RoCE guest over
    verbs: each segment is one memory registration of its window, made again for the next."""
    cfg = make_cfg(target="exact", staging_mib=1, speculate=True)
    pd = make_pd(cfg)
    decode = pd.decode.mgr
    plan = StreamPlan.build(decode.lynx.codec, decode.pool.shape, WINDOWED_TOKENS,
                            decode.lynx.chunk_tokens)
    assert plan.staging_bytes > decode.staging.nbytes
    with caplog.at_level(logging.INFO, logger="lynx_sglang.backend.decode.admission"):
        req = start_request(sgl, pd, room=9100, seed=100, tokens=WINDOWED_TOKENS)
        assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert "sent in 2 segments of 1 layers through 1 windows" in caplog.text
    assert decode.applier.residual_outcome(req.room) is None  # not reported at Anchor time
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            src = getattr(pd.prefill.pool, kind)[layer][req.prefill_slots]
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots], src)
    assert int(pd.decode.meta.bootstrap_room[req.decode_aux, 0]) == req.room  # the aux came
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert decode.staging.free_bytes() == decode.staging.nbytes
    assert decode.applier.tracked()["decode_rooms"] == 0
    for session in decode.applier.sessions._sessions.values():
        assert session.pending_requests() == [IDENTITY_REQUEST]  # the session's own answer
    # The session goes on serving ordinary rooms (speculative: Success at Anchor time, the
    # Residual after it).
    nxt = start_request(sgl, pd, room=9101, seed=101)
    assert poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
    wait_for("the next room's final KV", lambda: holds(pd, nxt, "full"))


def test_the_residual_hold_of_a_windowed_room_sits_after_its_first_segment(sgl, make_pd, caplog):
    """The fault-injection hold (`lynx-sglang faults --windowed`, phase `between`) of a room sent
    in segments comes after its first segment, both streams of it: the decode has that segment
    applied while the next one waits; released early, the room ends exact."""
    pd = make_pd(make_cfg(target="exact", staging_mib=1), residual_hold_s=LONG_HOLD_S)
    applier = pd.decode.mgr.applier
    with caplog.at_level(logging.WARNING, logger="lynx_sglang.backend.prefill.faults"):
        req = start_request(sgl, pd, room=9300, seed=105, tokens=WINDOWED_TOKENS)
        wait_for("the hold after the first segment",
              lambda: f"room {req.room} {FAULT_RESIDUAL_HOLD_LOG}" in caplog.text)
    room = applier.rooms.get(req.room)
    wait_for("the first segment applied at the decode", lambda: room.progress.seg_applied == 1)
    time.sleep(0.3)
    assert room.progress.seg_applied == 1  # the next segment waits for the hold
    assert req.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    release_holds_and_expect_full_kv(sgl, pd, req)


def test_the_anchor_hold_sits_mid_anchor(sgl, make_pd, caplog):
    """The fault-injection Anchor hold (`lynx-sglang faults`, phase `mid-anchor`) comes after the
    first half of the Anchor's layers: the decode has that half landed and counts the room in
    `decode_rooms_anchor_landing` while the rest waits; released early, the room ends exact."""
    pd = make_pd(make_cfg(target="exact"), anchor_hold_s=LONG_HOLD_S)
    applier = pd.decode.mgr.applier
    with caplog.at_level(logging.WARNING, logger="lynx_sglang.backend.prefill.faults"):
        req = start_request(sgl, pd, room=9400, seed=106)
        wait_for("the Anchor hold", lambda: f"room {req.room} {FAULT_ANCHOR_HOLD_LOG} after 1 of "
                                         f"{LAYERS} layers" in caplog.text)
    wait_for("half the Anchor landed at the decode",
          lambda: applier.tracked()["decode_rooms_anchor_landing"] == 1)
    room = applier.rooms.get(req.room)
    time.sleep(0.3)
    assert room.progress.anchor_layers_landed == 1  # the other layer waits for the hold
    assert req.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    release_holds_and_expect_full_kv(sgl, pd, req)
    assert applier.tracked()["decode_rooms_anchor_landing"] == 0


def test_a_room_dropped_between_segments_frees_the_prefill_worker_at_once(sgl, make_pd,
                                                                         monkeypatch):
    """The decode aborts a windowed room once its first segment is in: the prefill, waiting for
    the next segment's announcement, stops as soon as SGLang drops the room (not at the transfer
    timeout: it would hold the worker that every room to that decode needs), and both sides give
    all their staging back. The decode's applier leaves the windowed room alone here: it stands
    in for a decode slow to apply the first segment."""
    cfg = make_cfg(target="exact", staging_mib=1, speculate=True, transfer_timeout_s=60.0)
    pd = make_pd(cfg)
    applier = pd.decode.mgr.applier
    step = type(applier.windowed).step
    monkeypatch.setattr(type(applier.windowed), "step", lambda self, room: None)
    req = start_request(sgl, pd, room=9200, seed=102, tokens=WINDOWED_TOKENS)

    def first_segment_in() -> bool:
        room = applier.rooms.get(req.room)
        return (room is not None and room.session is not None
                and room.session.recv_state(req.room, Stream.RESIDUAL).ok)

    wait_for("the first segment at the decode", first_segment_in)
    t0 = time.monotonic()
    req.receiver.abort()
    assert req.receiver.poll() == sgl.KVPoll.Failed
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd), timeout=10.0)
    assert time.monotonic() - t0 < 10.0  # far inside the 60 s transfer timeout
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert applier.tracked()["decode_rooms"] == 0
    # The prefill's worker for this decode is free again: the next rooms go through.
    monkeypatch.setattr(type(applier.windowed), "step", step)
    for room, seed, tokens in ((9201, 103, NUM_TOKENS), (9202, 104, WINDOWED_TOKENS)):
        nxt = start_request(sgl, pd, room=room, seed=seed, tokens=tokens)
        assert poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
        wait_for("the next room's final KV", lambda nxt=nxt: holds(pd, nxt, "full"))
