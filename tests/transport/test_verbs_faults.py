"""Tests of the `verbs` backend (pyverbs RC QPs) on a real RDMA device with a misbehaving or dying
peer. They protect the bounds checks (an out-of-bounds write raises before anything is posted; a
peer that skips the check is refused by the receiver or, past its extent, by the NIC, with no byte
landing outside the extent and honest sessions unaffected), the FIN aux checksum (CORRUPTION on
both sides), and failing requests PEER_DIED when the peer process is killed (verbs data path) or
stopped (control-plane heartbeat). Honest-peer resources and data path are in
test_verbs_datapath.py.

They run inside the soft-RoCE QEMU guest (`scripts/rdma_vm.sh -- .venv/bin/python -m pytest -m
rdma_vm tests/transport`), where rxe0 exists; elsewhere they skip. The guest moves about 10 MB/s,
so transfers are small. Device / GID index come from LYNX_RDMA_DEVICE / LYNX_RDMA_GID_INDEX.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from session_pair import connected_pair, pattern, wait_until
from verbs_guest import (
    GUEST_MARKS,
    LONG_HEARTBEAT_S,
    A,
    KiB,
    R,
    device_options,
    read_line,
    spawn_peer,
    verbs_endpoint,
)

from lynx_transport import (
    Endpoint,
    FailureReason,
    OutOfBoundsError,
    PriorityPolicy,
    Status,
    WriteOp,
)

pytestmark = GUEST_MARKS


# ---------------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
def test_bounds_refused(pair):
    """Sender side: an out-of-bounds write raises before any work request is posted. Receiver
    side: a write outside the bounds (sender check skipped) fails the stream on both sides and
    its bytes are never counted as landed."""
    rx, tx, s_rx, s_tx = pair
    stage = np.zeros(128 * KiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(pattern(128 * KiB, 3))
    s_rx.announce(1, {A: [(dst.id, 0, 32 * KiB)]}, deadline_s=60)
    s_tx.wait_announcement(1, timeout=30)
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, A, src, 0, 32 * KiB + 1, dst.id, 0)
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, A, src, 0, 4 * KiB, dst.id, 64 * KiB)
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, R, src, 0, 4 * KiB, dst.id, 0)  # stream not announced
    time.sleep(0.2)
    assert tx.stats()["backend"]["chunks_sent"] == 0
    assert not stage.any()
    st = s_rx.recv_state(1, A)
    assert st.status is Status.PENDING and st.nbytes == 0

    # a peer that skips the sender-side check and writes inside an extent announced to it, but
    # names another request in its notice: the bytes land (one-sided), the receiver refuses them
    bad = Endpoint(backend="verbs", name="bad", peer_timeout_s=LONG_HEARTBEAT_S,
                   backend_options=device_options(), _unsafe_skip_bounds=True)
    try:
        s_bad = bad.connect(rx.address, timeout=30)
        s_rx2 = rx.accept(timeout=30)
        src2 = bad.register(pattern(16 * KiB, 4))
        s_rx2.announce(8, {A: [(dst.id, 0, 8 * KiB)]}, deadline_s=60)
        ann = s_bad.wait_announcement(8, timeout=30)
        ext, info = ann.find(A, dst.id, 0, 4 * KiB)
        bad.backend.post_write(WriteOp(s_bad.id, 99, A, src2, 0, 4 * KiB, dst.id, 0, ext, info))
        wait_until(lambda: rx.stats()["backend"]["refused"] >= 1, 30,
                   "the receiver refusing the write that names another request")
        assert rx.stats()["backend"]["refused"] == 1
        assert rx.stats().get("refused_unknown_request") == 1
        st8 = s_rx2.recv_state(8, A)
        assert st8.status is Status.PENDING and st8.nbytes == 0  # other requests unaffected
    finally:
        bad.close()


@pytest.mark.timeout(120)
def test_write_beyond_its_extent_is_refused_by_the_nic(pair):
    """A peer that skips the sender-side check and aims past its extent (with that extent's
    rkey: the only kind it was given) is refused by the NIC: not a byte lands outside the extent,
    its session fails on both sides, the honest session goes on. The announcement never carries
    the region-wide rkey."""
    rx, tx, s_rx, s_tx = pair
    stage = np.zeros(128 * KiB, np.uint8)
    dst = rx.register(stage)
    bad = Endpoint(backend="verbs", name="bad", peer_timeout_s=LONG_HEARTBEAT_S,
                   backend_options=device_options(), _unsafe_skip_bounds=True)
    try:
        s_bad = bad.connect(rx.address, timeout=30)
        s_rx2 = rx.accept(timeout=30)
        src = bad.register(np.full(16 * KiB, 0xEE, np.uint8))
        s_rx2.announce(7, {A: [(dst.id, 0, 8 * KiB)]}, deadline_s=60)
        ann = s_bad.wait_announcement(7, timeout=30)
        (target,) = ann.targets[A]
        assert target["rkey"] != dst.backend_handle.rkey and target["addr"] == dst.addr
        s_bad.write(7, A, src, 0, 8 * KiB, dst.id, 96 * KiB)
        s_bad.finish(7, A)
        sent = s_bad.wait_sent(7, A, timeout=30)
        assert sent.status is Status.FAILED, sent
        wait_until(lambda: s_rx2.closed, 30,
                   "the receiver closing the session whose write the NIC refused")
        assert s_bad.closed, "the misbehaving sender's session stayed open"
        assert not stage.any(), "bytes landed outside the announced extent"
        print(f"write beyond its extent: sender {sent.reason.value}: {sent.detail}; "
              f"receiver: {s_rx2.close_reason.value}: {s_rx2.close_detail}")
    finally:
        bad.close()
    assert rx.stats()["backend"]["exposed_extents"] == 0  # the closed session's are gone
    src_ok = tx.register(pattern(32 * KiB, 5))
    s_rx.announce(1, {A: [(dst.id, 0, 32 * KiB)]}, deadline_s=60)
    s_tx.wait_announcement(1, timeout=30)
    s_tx.write_stream(1, A, src_ok, 0, 32 * KiB)
    s_tx.finish(1, A)
    assert s_rx.wait(1, A, timeout=30).ok
    assert np.array_equal(stage[:32 * KiB], np.asarray(src_ok.view))


@pytest.mark.timeout(120)
def test_fin_aux_checksum():
    """A FIN whose aux bytes do not match their CRC fails the stream CORRUPTION on both sides; the
    request's other stream and the session go on."""
    from lynx_transport.verbs_wire import FIN

    def corrupt_anchor_fin(sid, stream, notice):  # the backend's test seam, "_corrupt_notice"
        return notice[:-1] + bytes([notice[-1] ^ 0xFF]) if stream is A and notice[4] == FIN else notice

    sender = verbs_endpoint("tx", _corrupt_notice=corrupt_anchor_fin)
    for endpoints_and_sessions in connected_pair(verbs_endpoint("rx"), sender, timeout=30):
        _fin_aux_checksum(*endpoints_and_sessions)


def _fin_aux_checksum(rx, tx, s_rx, s_tx):
    stage = np.zeros(64 * KiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(pattern(64 * KiB, 6))
    s_rx.announce(1, {A: [(dst.id, 0, 32 * KiB)], R: [(dst.id, 32 * KiB, 32 * KiB)]},
                  deadline_s=60)
    s_tx.wait_announcement(1, timeout=30)
    s_tx.write_stream(1, A, src, 0, 32 * KiB)
    s_tx.finish(1, A, aux=b"first-token")
    s_tx.write_stream(1, R, src, 32 * KiB, 32 * KiB)
    s_tx.finish(1, R, aux=b"fine")
    a = s_rx.wait(1, A, timeout=30)
    assert a.status is Status.FAILED and a.reason is FailureReason.CORRUPTION, a
    assert "checksum" in a.detail
    r = s_rx.wait(1, R, timeout=30)
    assert r.ok and r.aux == b"fine", r
    sent = s_tx.wait_sent(1, A, timeout=30)
    assert sent.status is Status.FAILED and sent.reason is FailureReason.CORRUPTION
    assert not s_rx.closed


@pytest.mark.timeout(240)
def test_sender_killed_mid_residual_fails_request():
    """The sender process dies while its Residual is landing: the receiver's Residual fails
    PEER_DIED (noticed by the verbs keepalive probe: the control-plane heartbeat timeout is set
    far longer), the Anchor that landed stays COMPLETE."""
    rx = verbs_endpoint("rx")
    proc = None
    try:
        n_a, n_r = 64 * KiB, 4096 * KiB  # ~0.4 s at the guest's ~10 MB/s: killed while moving
        proc = spawn_peer("sender", rx.address, str(n_a), str(n_r))
        s_rx = rx.accept(timeout=90)
        assert s_rx is not None
        stage = np.zeros(n_a + n_r, np.uint8)
        dst = rx.register(stage)
        s_rx.announce(1, {A: [(dst.id, 0, n_a)], R: [(dst.id, n_a, n_r)]}, deadline_s=120)
        a = s_rx.wait(1, A, timeout=90)
        assert a.ok and a.aux == b"first-token", a
        wait_until(lambda: s_rx.recv_state(1, R).nbytes > 0, 30,
                   "the Residual's first byte at the receiver", poll_s=0.002)
        proc.kill()
        t_kill = time.monotonic()
        r = s_rx.wait(1, R, timeout=30)
        assert r.status is Status.FAILED and r.reason is FailureReason.PEER_DIED, r
        assert r.t_done - t_kill < 15.0, r.t_done - t_kill
        assert 0 < r.nbytes < n_r
        assert s_rx.recv_state(1, A).ok  # what landed stays landed
        print(f"sender killed: receiver failed the Residual after {r.t_done - t_kill:.2f}s "
              f"({r.nbytes}/{n_r} B landed): {r.detail}")
        s_rx.release(1)
        rx.deregister(dst)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(30)
        rx.close()


@pytest.mark.timeout(240)
def test_receiver_killed_mid_anchor_fails_request():
    """The receiver process dies while the Anchor is in flight: the sender's Anchor (and the
    Residual queued behind it) fail PEER_DIED from the failed RDMA work requests."""
    n_a, n_r = 4096 * KiB, 64 * KiB
    proc = spawn_peer("receiver", str(n_a), str(n_r))
    tx = verbs_endpoint("tx")
    try:
        address = read_line(proc, 90)
        s_tx = tx.connect(address, timeout=60)
        src = tx.register(pattern(n_a + n_r, 5))
        s_tx.wait_announcement(1, timeout=60)
        s_tx.write_stream(1, A, src, 0, n_a)
        s_tx.finish(1, A)
        s_tx.write_stream(1, R, src, n_a, n_r)
        s_tx.finish(1, R)
        wait_until(lambda: s_tx.send_state(1, A).nbytes > 0, 30,
                   "the Anchor's first byte leaving the sender", poll_s=0.002)
        proc.kill()
        t_kill = time.monotonic()
        st = s_tx.wait_sent(1, A, timeout=30)
        assert st.status is Status.FAILED and st.reason is FailureReason.PEER_DIED, st
        assert st.t_done - t_kill < 15.0, st.t_done - t_kill
        assert st.nbytes < n_a
        r = s_tx.wait_sent(1, R, timeout=30)
        assert r.status is Status.FAILED and r.reason is FailureReason.PEER_DIED, r
        print(f"receiver killed: sender failed the Anchor after {st.t_done - t_kill:.2f}s "
              f"({st.nbytes}/{n_a} B sent): {st.detail}")
        s_tx.release(1, timeout=5)
        tx.deregister(src)
    finally:
        proc.kill()
        proc.wait(30)
        tx.close()


@pytest.mark.timeout(240)
def test_receiver_stalled_fails_by_heartbeat():
    """A stopped (SIGSTOP) receiver still ACKs RDMA at the NIC/kernel level but stops taking
    notices and control messages: the sender stalls (receiver-not-ready) and the request fails
    PEER_DIED once the control-plane heartbeat times out; tearing down the stalled QPs is clean."""
    n_a, n_r = 4096 * KiB, 64 * KiB
    proc = spawn_peer("receiver", str(n_a), str(n_r))
    tx = Endpoint(backend="verbs", name="tx", peer_timeout_s=3.0,
                  policy=PriorityPolicy(chunk_bytes=16 * KiB), backend_options=device_options())
    try:
        address = read_line(proc, 90)
        s_tx = tx.connect(address, timeout=60)
        src = tx.register(pattern(n_a + n_r, 6))
        s_tx.wait_announcement(1, timeout=60)
        s_tx.write_stream(1, A, src, 0, n_a)
        s_tx.finish(1, A)
        wait_until(lambda: s_tx.send_state(1, A).nbytes > 0, 30,
                   "the Anchor's first byte leaving the sender", poll_s=0.002)
        os.kill(proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        st = s_tx.wait_sent(1, A, timeout=60)
        assert st.status is Status.FAILED and st.reason is FailureReason.PEER_DIED, st
        assert st.t_done - t_stop < 30.0, st.t_done - t_stop
        assert st.nbytes < n_a
        print(f"receiver stopped: sender failed the Anchor after {st.t_done - t_stop:.2f}s "
              f"({st.nbytes}/{n_a} B sent): {st.detail}")
        s_tx.release(1, timeout=5)
        tx.deregister(src)
    finally:
        proc.kill()
        proc.wait(30)
        tx.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("lynx-verbs")]
