"""Loopback tests of lynx_transport's fault handling (tcp backend): the stall deadline counts from
the latest landed byte (a late start or a long transfer that keeps landing does not fail), the
announcement deadline bounds a trickle, a stream not started when the receiver gave up cannot be
sent later, and a peer process killed or stopped mid-Residual fails the stream as PEER_DIED while
what had landed stays landed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from session_pair import pattern

from lynx_transport import (
    Endpoint,
    FailureReason,
    Status,
    Stream,
    TransportError,
    UnknownRequestError,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
PEER = Path(__file__).with_name("peer_proc.py")
MiB = 1 << 20


def test_stall_deadline_counts_from_the_latest_landed_byte(pair):
    """A peer may start late (behind its queue) without failing the request; once bytes land, it
    fails when none lands for the stall deadline."""
    rx, tx, s_rx, s_tx = pair
    dst = rx.register(np.zeros(MiB, np.uint8))
    src = tx.register(pattern(MiB, 5))
    s_rx.announce(1, {A: [(dst.id, 0, MiB)]}, stall_deadline_s=0.3)
    s_tx.wait_announcement(1, timeout=5)
    time.sleep(0.8)  # well past 0.3 s, nothing sent yet: still pending
    assert s_rx.recv_state(1, A).status is Status.PENDING
    s_tx.write(1, A, src, 0, 4096, dst.id, 0)  # some bytes, never the rest nor the end
    st = s_rx.wait(1, A, timeout=5)
    assert st.status is Status.FAILED and st.reason is FailureReason.TIMEOUT
    assert "no byte landed for 0.3 s" in st.detail
    assert st.t_done - st.t_first_byte < 1.5  # from the bytes, not the announcement
    s_rx.release(1)


def test_a_transfer_that_keeps_landing_outlasts_the_stall_deadline(pair):
    """A layer-streamed prefill sends a layer at a time while its forward computes: the transfer
    lasts as long as the forward, far past the stall deadline, and completes. (Before, the
    deadline counted from the first landed byte and failed it.)"""
    rx, tx, s_rx, s_tx = pair
    piece, pieces = 4096, 12
    stage = np.zeros(piece * pieces, np.uint8)
    dst = rx.register(stage)
    src_arr = pattern(piece * pieces, 7)
    src = tx.register(src_arr)
    s_rx.announce(3, {A: [(dst.id, 0, piece * pieces)]}, stall_deadline_s=0.5)
    s_tx.wait_announcement(3, timeout=5)
    t0 = time.monotonic()
    for i in range(pieces):  # 12 x 0.15 s: 1.8 s in all, over three times the deadline
        s_tx.write(3, A, src, i * piece, piece, dst.id, i * piece)
        time.sleep(0.15)
    s_tx.finish(3, A)
    st = s_rx.wait(3, A, timeout=5)
    assert time.monotonic() - t0 > 3 * 0.5
    assert st.status is Status.COMPLETE, st.detail
    assert np.array_equal(stage, src_arr)
    s_rx.release(3)


def test_the_announcement_deadline_bounds_a_transfer_that_trickles(pair):
    """A peer that keeps landing a byte now and then is still bounded by the deadline from the
    announcement, and the failure says which deadline passed."""
    rx, tx, s_rx, s_tx = pair
    dst = rx.register(np.zeros(MiB, np.uint8))
    src = tx.register(pattern(MiB, 8))
    s_rx.announce(4, {A: [(dst.id, 0, MiB)]}, deadline_s=1.0, stall_deadline_s=0.5)
    s_tx.wait_announcement(4, timeout=5)
    for i in range(40):
        if s_rx.recv_state(4, A).status is not Status.PENDING:
            break
        with contextlib.suppress(TransportError):
            s_tx.write(4, A, src, i * 64, 64, dst.id, i * 64)
        time.sleep(0.1)
    st = s_rx.wait(4, A, timeout=5)
    assert st.status is Status.FAILED and st.reason is FailureReason.TIMEOUT
    assert "1 s since the announcement" in st.detail
    s_rx.release(4)


def test_a_stream_not_started_when_the_receiver_gave_up_cannot_be_sent_later(pair):
    """The receiver's deadline fails the request while the sender has not started its Residual
    yet; once the receiver releases it, the sender's late Residual is refused at once. Before, the
    release of a request with no stream pending told the sender nothing: its late writes were
    accepted, dropped by the receiver, and its Residual stayed PENDING for good (a prefill kept
    the room's staging until the session ended)."""
    rx, tx, s_rx, s_tx = pair
    dst = rx.register(np.zeros(2 * 4096, np.uint8))
    src = tx.register(pattern(2 * 4096, 6))
    s_rx.announce(2, {A: [(dst.id, 0, 4096)], R: [(dst.id, 4096, 4096)]}, stall_deadline_s=0.3)
    s_tx.wait_announcement(2, timeout=5)
    s_tx.write_stream(2, A, src, 0, 4096)
    s_tx.finish(2, A)
    st = s_rx.wait(2, R, timeout=5)
    assert st.status is Status.FAILED and st.reason is FailureReason.TIMEOUT
    assert s_tx.send_state(2, R).status is Status.PENDING  # never started: the abort spared it
    s_rx.release(2)
    deadline = time.monotonic() + 5
    while 2 not in s_tx._peer_released and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(UnknownRequestError):
        s_tx.write_stream(2, R, src, 4096, 4096)
    with pytest.raises(UnknownRequestError):
        s_tx.finish(2, R)
    s_tx.release(2)


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.timeout(60)
def test_sender_killed_mid_residual():
    rx = Endpoint(name="rx", peer_timeout_s=2.0)
    proc = None
    try:
        n = 64 * MiB
        proc = _spawn("sender", rx.address, str(n), str(20_000_000))
        s_rx = rx.accept(timeout=20)
        assert s_rx is not None
        stage = np.zeros(n + MiB, np.uint8)
        dst = rx.register(stage)
        s_rx.announce(1, {A: [(dst.id, 0, MiB)], R: [(dst.id, MiB, n)]})
        a = s_rx.wait(1, A, timeout=20)
        assert a.ok and a.aux == b"first-token"
        while s_rx.recv_state(1, R).nbytes < 2 * MiB:
            time.sleep(0.01)
        proc.kill()
        r = s_rx.wait(1, R, timeout=10)  # the socket closes: failure well within this bound
        assert r.status is Status.FAILED and r.reason is FailureReason.PEER_DIED, r
        assert s_rx.recv_state(1, A).ok  # the anchor that landed stays landed
        s_rx.release(1)
        rx.deregister(dst)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        rx.close()


@pytest.mark.timeout(60)
def test_receiver_killed_and_receiver_stalled():
    for mode in ("kill", "stop"):
        proc = _spawn("receiver", str(256 * MiB))
        tx = Endpoint(name="tx", peer_timeout_s=1.5, backend_options={"_throttle_bps": 50_000_000})
        try:
            address = proc.stdout.readline().strip()
            s_tx = tx.connect(address, timeout=20)
            src = tx.register(np.ones(257 * MiB, np.uint8))
            s_tx.wait_announcement(1, timeout=20)
            s_tx.write_stream(1, A, src, 0, MiB)
            s_tx.finish(1, A)
            assert s_tx.wait_sent(1, A, timeout=20).ok
            s_tx.write_stream(1, R, src, MiB, 256 * MiB)
            s_tx.finish(1, R)
            while s_tx.send_state(1, R).nbytes < 4 * MiB:
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            # kill: the socket closes; stop: no socket event, the heartbeats stop (1.5 s)
            st = s_tx.wait_sent(1, R, timeout=15)
            assert st.status is Status.FAILED and st.reason is FailureReason.PEER_DIED, (mode, st)
            s_tx.release(1, timeout=1.0)
            tx.deregister(src)
        finally:
            proc.kill()
            proc.wait()
            tx.close()
