"""Failures around a transfer between Lynx's prefill and decode KV managers with SGLang's own
machinery in one process (conn_pair.py): a decode abort mid-transfer, the decode's deadline
passing while the prefill holds the Residual, the prefill's data plane dying mid-transfer or
idle, a room the decode refuses before any transfer. Each fails the room on the side(s) it must,
promptly and with its reason, writes nothing more into the decode's pool, gives every staging
range back, and leaves the session (or, for a dead prefill, SGLang's cached bootstrap info) in a
state where the next request goes through.
"""

from __future__ import annotations

import time

import pytest
import torch
from conn_pair import (
    LONG_HOLD_S,
    NUM_TOKENS,
    RESIDUAL_HOLD_S,
    anchor_in,
    failure_message,
    holds,
    let_residual_go_after_release,
    make_cfg,
    poll_until_done,
    prefill_staging_free,
    start_request,
    wait_for,
)

pytestmark = pytest.mark.sglang


def test_abort_mid_transfer_frees_staging(sgl, make_pd):
    pd = make_pd(make_cfg(target="exact", transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    decode = pd.decode.mgr
    req = start_request(sgl, pd, room=4004, seed=4)
    wait_for("the whole Anchor at the decode", lambda: anchor_in(pd, req))
    assert decode.staging.free_bytes() < decode.staging.nbytes
    req.receiver.abort()
    assert req.receiver.poll() == sgl.KVPoll.Failed
    assert decode.staging.free_bytes() == decode.staging.nbytes
    # The prefill sends the Residual of the now unknown room once let go (every later room's
    # too: the release stays set): it fails the room, and nothing lands in the decode pool.
    let_residual_go_after_release(pd, req)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    assert not holds(pd, req, "full")
    assert decode.staging.free_bytes() == decode.staging.nbytes
    # The session between the two survives an aborted room: the next request goes through.
    nxt = start_request(sgl, pd, room=4005, seed=5)
    assert poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
    assert holds(pd, nxt, "full")


def test_a_room_the_decode_timed_out_before_its_residual_frees_the_prefill(sgl, make_pd):
    """The decode's transfer deadline fails the room while the prefill still holds the Residual
    back (here the fault-injection hold; in service a Residual encode slower than the deadline):
    the prefill's late Residual is refused at once and the room's staging comes back. Before, its
    Residual stream stayed pending with nobody to acknowledge it, and the staging was held until
    the session ended."""
    hold = 3.0
    pd = make_pd(make_cfg(target="exact", transfer_timeout_s=1.0), residual_hold_s=hold)
    req = start_request(sgl, pd, room=4024, seed=24)
    t0 = time.monotonic()
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    assert "receiver deadline passed" in failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd),
          timeout=hold + 10.0)
    assert time.monotonic() - t0 < hold + 10.0
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_in_flight"] == 0
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


def test_prefill_staging_freed_after_decode_abort(sgl, make_pd):
    pd = make_pd(make_cfg(target="exact", transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    req = start_request(sgl, pd, room=4014, seed=4)
    wait_for("the whole Anchor at the decode", lambda: anchor_in(pd, req))
    req.receiver.abort()
    let_residual_go_after_release(pd, req)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    # The reaper runs every 50 ms: a few seconds is a generous bound for a freed range.
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd), timeout=5.0)


def test_prefill_death_mid_transfer_fails_the_room(sgl, make_pd):
    pd = make_pd(make_cfg(target="exact"), residual_hold_s=RESIDUAL_HOLD_S)
    req = start_request(sgl, pd, room=5005, seed=6)
    wait_for("the whole Anchor at the decode", lambda: anchor_in(pd, req))
    pd.prefill.mgr.endpoint.close()  # the prefill's data plane dies between the two streams
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    msg = failure_message(sgl, req.receiver)
    assert "Residual stream failed" in msg, msg
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert not holds(pd, req, "full")


def test_an_idle_prefill_that_dies_is_forgotten(sgl, make_pd):
    """A prefill rank that dies with none of its rooms in flight must be forgotten too: the
    decode used to drop its cached bootstrap info only when a room failed, so after a restart
    (SGLang's heartbeat slower, or off) the next request went to the dead rank and hung."""
    pd = make_pd(make_cfg(target="exact"))
    req = start_request(sgl, pd, room=5006, seed=7)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert pd.decode.mgr.connection_pool, "SGLang cached no bootstrap info to drop"
    pd.prefill.mgr.endpoint.close()  # the prefill's data plane dies while idle
    wait_for("the decode to drop the dead rank's bootstrap info",
          lambda: not pd.decode.mgr.connection_pool)


def test_a_decode_setup_failure_reaches_the_prefill_at_once(sgl, make_pd):
    """The decode refuses a room before any transfer (here: a decode-side prefix, which Lynx does
    not support): the prefill hears it at once instead of waiting for metadata until SGLang's
    bootstrap timeout (300 s)."""
    pd = make_pd(make_cfg(target="exact"))
    room = 7007
    sender = sgl.Sender(mgr=pd.prefill.mgr, bootstrap_addr=pd.bootstrap_addr, bootstrap_room=room)
    receiver = sgl.Receiver(mgr=pd.decode.mgr, bootstrap_addr=pd.bootstrap_addr,
                            bootstrap_room=room)
    assert pd.decode.mgr.try_ensure_parallel_info(pd.bootstrap_addr)
    receiver.init(0)
    slots = (torch.arange(NUM_TOKENS) + 1).to(torch.int32).numpy()
    receiver.send_metadata(slots, 0, decode_prefix_len=4)
    assert receiver.poll() == sgl.KVPoll.Failed
    assert "prefix cache" in failure_message(sgl, receiver)
    t0 = time.monotonic()
    assert poll_until_done(sgl, sender) == sgl.KVPoll.Failed
    assert time.monotonic() - t0 < 10.0


def test_a_room_its_decode_aborted_before_it_reached_the_prefill_fails_at_once(sgl, make_pd):
    """A decode refusing a request as its receiver is created tells the prefill at once, and
    that abort can beat the request to the prefill (seen with unequal TP: the request then sat in
    Bootstrapping for SGLang's 300 s bootstrap timeout). The prefill remembers the abort and
    fails the room when SGLang opens it; a later room is not affected."""
    from lynx_sglang.backend.prefill.role import EARLY_ABORT_REASON

    pd = make_pd(make_cfg(target="exact"))
    prefill = pd.prefill.mgr
    receiver = sgl.Receiver(mgr=pd.decode.mgr, bootstrap_addr=pd.bootstrap_addr,
                            bootstrap_room=4031)
    assert pd.decode.mgr.try_ensure_parallel_info(pd.bootstrap_addr)
    receiver.init(0)
    receiver.abort()
    wait_for("the prefill to remember the abort", lambda: len(prefill.role.early_aborts) == 1)
    sender = sgl.Sender(mgr=prefill, bootstrap_addr=pd.bootstrap_addr, bootstrap_room=4031)
    assert sender.poll() == sgl.KVPoll.Failed
    assert EARLY_ABORT_REASON in failure_message(sgl, sender)
    assert len(prefill.role.early_aborts) == 0
    nxt = start_request(sgl, pd, room=4032, seed=32)
    assert poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
    assert holds(pd, nxt, "full")


def test_remembered_early_aborts_are_bounded_in_number_and_time():
    from lynx_sglang.backend.prefill.early_aborts import EarlyAborts

    aborts = EarlyAborts(ttl_s=0.2, cap=3)
    with aborts.lock:
        for room in range(5):
            aborts.note(room)
        assert len(aborts) == 3 and not aborts.take(0) and aborts.take(4)
    time.sleep(0.3)
    with aborts.lock:
        assert not aborts.take(3) and len(aborts) == 0
