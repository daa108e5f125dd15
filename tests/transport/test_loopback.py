"""Loopback tests of lynx_transport's API, safety checks and fault handling (tcp backend)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from session_pair import connected_pair, pattern

from lynx_transport import (
    Endpoint,
    FailureReason,
    HandshakeError,
    OutOfBoundsError,
    PriorityPolicy,
    RegionError,
    Status,
    Stream,
    StreamStateError,
    TransportError,
    UnknownRequestError,
    WriteOp,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
PEER = Path(__file__).with_name("peer_proc.py")
MiB = 1 << 20


@pytest.fixture
def pair():
    """(receiver endpoint, sender endpoint, receiver session, sender session)."""
    yield from connected_pair(Endpoint(name="rx", peer_timeout_s=3.0),
                              Endpoint(name="tx", peer_timeout_s=3.0), timeout=5)


class CorruptNext:
    """The tcp backend's test seam (option "_corrupt_checksum"): the next DATA chunk sent on an
    armed stream carries a wrong checksum."""

    def __init__(self):
        self._armed: set = set()
        self._lock = threading.Lock()  # armed by the test thread, consumed by the sender thread

    def arm(self, stream: Stream) -> None:
        with self._lock:
            self._armed.add(stream)

    def __call__(self, sid: bytes, stream: Stream, checksum: int) -> int:
        with self._lock:
            if stream not in self._armed:
                return checksum
            self._armed.discard(stream)
        return checksum ^ 0x5A5A5A5A


@pytest.fixture
def corrupting_pair():
    """`pair` whose sender corrupts through `CorruptNext`, yielded as a fifth item."""
    corrupt = CorruptNext()
    tx = Endpoint(name="tx", peer_timeout_s=3.0, backend_options={"_corrupt_checksum": corrupt})
    for endpoints_and_sessions in connected_pair(Endpoint(name="rx", peer_timeout_s=3.0), tx,
                                                 timeout=5):
        yield (*endpoints_and_sessions, corrupt)


@pytest.mark.timeout(60)
def test_roundtrip_api(pair):
    rx, tx, s_rx, s_tx = pair
    n_a, n_r = 3 * MiB + 17, 5 * MiB + 3
    stage = np.zeros(n_a + n_r + 100, np.uint8)
    dst = rx.register(stage)
    src_arr = pattern(n_a + n_r, 1)
    src = tx.register(src_arr)
    # announced in two extents for the residual, to exercise write_stream's scatter
    s_rx.announce(5, {A: [(dst.id, 0, n_a)],
                      R: [(dst.id, n_a, n_r // 2), (dst.id, n_a + n_r // 2, n_r - n_r // 2)]},
                  meta=b"slot-3")
    ann = s_tx.wait_announcement(5, timeout=5)
    assert ann.meta == b"slot-3" and ann.stream_nbytes(R) == n_r
    st = s_rx.recv_state(5, A)
    assert st.status is Status.PENDING and st.expected == n_a and st.nbytes == 0
    s_tx.write_stream(5, A, src, 0, n_a)
    s_tx.finish(5, A, aux=b"\x01\x02token")
    s_tx.write_stream(5, R, src, n_a, n_r)
    s_tx.finish(5, R)
    a = s_rx.wait(5, A, timeout=10)
    r = s_rx.wait(5, R, timeout=10)
    assert a.ok and r.ok, (a, r)
    assert a.aux == b"\x01\x02token" and r.aux == b""
    assert a.nbytes == n_a and r.nbytes == n_r
    assert a.t_start <= a.t_first_byte <= a.t_done
    assert np.array_equal(stage[: n_a + n_r], src_arr)
    assert not stage[n_a + n_r:].any()
    assert s_tx.wait_sent(5, A, timeout=5).ok
    assert s_tx.wait_sent(5, R, timeout=5).ok
    with pytest.raises(StreamStateError):
        s_tx.finish(5, A)
    with pytest.raises(RegionError):
        rx.deregister(dst)  # still referenced by the announcement
    s_rx.release(5)
    s_tx.release(5)
    with pytest.raises(UnknownRequestError):
        s_rx.recv_state(5, A)
    rx.deregister(dst)
    tx.deregister(src)


@pytest.mark.timeout(60)
def test_complete_counts_every_byte_when_the_ack_overtakes_local_completions(pair, monkeypatch):
    """Over verbs the receiver can ACK a stream before this host has counted its own last write
    completions (seen once in the soft-RoCE guest: COMPLETE with 131072 of 204805 B). The local
    counts are held back here until after the ACK: COMPLETE must still say every byte, and the
    late counts must not push it past the stream's size."""
    from lynx_transport.sender import SenderRole

    rx, tx, s_rx, s_tx = pair
    held: list[tuple] = []
    real = SenderRole.on_sent
    monkeypatch.setattr(SenderRole, "on_sent", lambda self, *a: held.append((self, a)))
    n = 200 * 1024 + 5
    stage = np.zeros(n, np.uint8)
    dst = rx.register(stage)
    src = tx.register(pattern(n, 4))
    s_rx.announce(4, {A: [(dst.id, 0, n)], R: [(dst.id, 0, 0)]})
    s_tx.wait_announcement(4, timeout=5)
    s_tx.write_stream(4, A, src, 0, n)
    s_tx.finish(4, A)
    assert s_rx.wait(4, A, timeout=10).ok
    sent = s_tx.wait_sent(4, A, timeout=10)
    assert sent.ok and sent.nbytes == sent.expected == n, sent
    assert held, "no local completion was held back: the test did not order the events"
    for self_, args in held:
        real(self_, *args)
    assert s_tx.send_state(4, A).nbytes == n


@pytest.mark.timeout(60)
def test_raw_pointer_regions_and_empty_stream(pair):
    rx, tx, s_rx, s_tx = pair
    n = 1 * MiB
    dst_buf = (ctypes.c_uint8 * n)()
    src_buf = (ctypes.c_uint8 * n).from_buffer_copy(pattern(n, 2).tobytes())
    dst = rx.register(ctypes.addressof(dst_buf), n)
    src = tx.register(ctypes.addressof(src_buf), n)
    s_rx.announce(1, {A: [(dst.id, 0, n)], R: [(dst.id, 0, 0)]})
    s_tx.wait_announcement(1, timeout=5)
    s_tx.write(1, A, src, 0, n, dst.id, 0)
    s_tx.finish(1, A)
    s_tx.finish(1, R)  # an empty stream completes too
    assert s_rx.wait(1, A, timeout=10).ok
    r = s_rx.wait(1, R, timeout=10)
    assert r.ok and r.nbytes == 0
    assert bytes(dst_buf) == bytes(src_buf)
    s_rx.release(1)
    s_tx.release(1)


@pytest.mark.timeout(120)
def test_many_concurrent_requests_distinct_patterns(pair):
    rx, tx, s_rx, s_tx = pair
    nreq, n_a, n_r = 48, 40_000, 150_001
    per = n_a + n_r
    stage = np.zeros(nreq * per, np.uint8)
    dst = rx.register(stage)
    src_arr = np.empty(nreq * per, np.uint8)
    for i in range(nreq):
        src_arr[i * per:(i + 1) * per] = (i * 5 + 1) % 251
    src = tx.register(src_arr)
    for i in range(nreq):
        s_rx.announce(100 + i, {A: [(dst.id, i * per, n_a)], R: [(dst.id, i * per + n_a, n_r)]})

    def send(ids):
        for i in ids:
            s_tx.wait_announcement(100 + i, timeout=10)
            s_tx.write_stream(100 + i, A, src, i * per, n_a)
            s_tx.finish(100 + i, A, aux=i.to_bytes(2, "little"))
            s_tx.write_stream(100 + i, R, src, i * per + n_a, n_r)
            s_tx.finish(100 + i, R)

    threads = [threading.Thread(target=send, args=(range(k, nreq, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(nreq):
        a = s_rx.wait(100 + i, A, timeout=20)
        r = s_rx.wait(100 + i, R, timeout=20)
        assert a.ok and r.ok, (i, a, r)
        assert int.from_bytes(a.aux, "little") == i
        block = stage[i * per:(i + 1) * per]
        assert (block == (i * 5 + 1) % 251).all(), f"cross-request bytes in request {i}"
    for i in range(nreq):
        s_rx.release(100 + i)
        s_tx.release(100 + i)


@pytest.mark.timeout(60)
def test_out_of_bounds_refused_on_both_sides(pair):
    rx, tx, s_rx, s_tx = pair
    stage = np.zeros(4 * MiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(np.full(MiB, 7, np.uint8))
    s_rx.announce(1, {A: [(dst.id, 0, MiB)], R: [(dst.id, MiB, MiB)]})
    s_tx.wait_announcement(1, timeout=5)
    # the sender's own check refuses before anything is sent
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, A, src, 0, MiB, dst.id, MiB)  # that is the RESIDUAL's range
    with pytest.raises(OutOfBoundsError):
        s_tx.write_stream(1, A, src, 0, MiB, stream_offset=1)

    # a peer that skips its checks: the receiver refuses before any byte lands
    evil = Endpoint(name="evil", _unsafe_skip_bounds=True)
    try:
        s_evil = evil.connect(rx.address, timeout=5)
        s_rx2 = rx.accept(timeout=5)
        esrc = evil.register(np.full(MiB, 0xEE, np.uint8))
        s_rx2.announce(9, {A: [(dst.id, 2 * MiB, MiB // 2)]})
        s_evil.wait_announcement(9, timeout=5)
        s_evil.write(9, A, esrc, 0, MiB, dst.id, 2 * MiB)  # twice the announced length
        s_evil.finish(9, A)
        st = s_rx2.wait(9, A, timeout=10)
        assert st.status is Status.FAILED and st.reason is FailureReason.OUT_OF_BOUNDS, st
        assert not stage[2 * MiB:].any(), "refused bytes landed"
        est = s_evil.wait_sent(9, A, timeout=10)
        assert est.status is Status.FAILED and est.reason is FailureReason.OUT_OF_BOUNDS, est
        assert rx.stats()["refused_out_of_bounds"] >= 1
    finally:
        evil.close()

    # the honest session is unaffected
    s_tx.write_stream(1, A, src, 0, MiB)
    s_tx.finish(1, A)
    assert s_rx.wait(1, A, timeout=10).ok
    assert (stage[:MiB] == 7).all()


@pytest.mark.timeout(60)
def test_unknown_request_and_released_request_refused(pair):
    rx, tx, s_rx, s_tx = pair
    stage = np.zeros(2 * MiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(np.full(MiB, 3, np.uint8))
    # bypass the sender's checks by posting straight to the backend
    tx.backend.post_write(WriteOp(s_tx.id, 424242, A, src, 0, MiB, dst.id, 0))
    deadline = time.monotonic() + 5
    while rx.stats().get("refused_unknown_request", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats().get("refused_unknown_request", 0) >= 1
    assert not stage.any()

    # released: the bounds are gone, later writes are refused as unknown
    s_rx.announce(2, {A: [(dst.id, 0, MiB)]})
    s_tx.wait_announcement(2, timeout=5)
    s_rx.release(2)
    time.sleep(0.2)  # let RELEASE reach the sender
    with pytest.raises(UnknownRequestError):
        s_tx.write(2, A, src, 0, MiB, dst.id, 0)
    tx.backend.post_write(WriteOp(s_tx.id, 2, A, src, 0, MiB, dst.id, 0))
    deadline = time.monotonic() + 5
    while rx.stats().get("refused_unknown_request", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rx.stats()["refused_unknown_request"] >= 2
    assert not stage.any()

    # and the session still works
    s_rx.announce(3, {A: [(dst.id, MiB, MiB)]})
    s_tx.wait_announcement(3, timeout=5)
    s_tx.write_stream(3, A, src, 0, MiB)
    s_tx.finish(3, A)
    assert s_rx.wait(3, A, timeout=10).ok
    assert (stage[MiB:] == 3).all() and not stage[:MiB].any()


@pytest.mark.timeout(60)
def test_corrupt_chunk_reported_never_complete(corrupting_pair):
    rx, tx, s_rx, s_tx, corrupt = corrupting_pair
    stage = np.zeros(8 * MiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(pattern(8 * MiB, 3))
    s_rx.announce(1, {A: [(dst.id, 0, 2 * MiB)], R: [(dst.id, 2 * MiB, 2 * MiB)]})
    s_rx.announce(2, {A: [(dst.id, 4 * MiB, 2 * MiB)], R: [(dst.id, 6 * MiB, 2 * MiB)]})
    s_tx.wait_announcement(2, timeout=5)
    corrupt.arm(A)
    for req, base in ((1, 0), (2, 4 * MiB)):
        s_tx.write_stream(req, A, src, base, 2 * MiB)
        s_tx.finish(req, A)
        s_tx.write_stream(req, R, src, base + 2 * MiB, 2 * MiB)
        s_tx.finish(req, R)
    a1 = s_rx.wait(1, A, timeout=10)
    assert a1.status is Status.FAILED and a1.reason is FailureReason.CORRUPTION, a1
    assert "checksum" in a1.detail
    sa1 = s_tx.wait_sent(1, A, timeout=10)
    assert sa1.status is Status.FAILED and sa1.reason is FailureReason.CORRUPTION
    # the other stream and the other request are unaffected
    assert s_rx.wait(1, R, timeout=10).ok
    assert s_rx.wait(2, A, timeout=10).ok and s_rx.wait(2, R, timeout=10).ok
    assert np.array_equal(stage[4 * MiB:], np.asarray(src.view[4 * MiB:]))


@pytest.mark.timeout(60)
def test_checksum_off_and_weighted_policy():
    rx = Endpoint(name="rx", checksum=False)
    tx = Endpoint(name="tx", checksum=False,
                  policy=PriorityPolicy(mode="weighted", residual_share=0.25, chunk_bytes=64 << 10),
                  backend_options={"_throttle_bps": 100_000_000})
    try:
        s_tx = tx.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        n = 8 * MiB
        stage = np.zeros(2 * n, np.uint8)
        dst = rx.register(stage)
        src_arr = pattern(2 * n, 4)
        src = tx.register(src_arr)
        s_rx.announce(1, {A: [(dst.id, 0, n)], R: [(dst.id, n, n)]})
        s_tx.wait_announcement(1, timeout=5)
        s_tx.write_stream(1, R, src, n, n)
        s_tx.write_stream(1, A, src, 0, n)
        s_tx.finish(1, A)
        s_tx.finish(1, R)
        a = s_rx.wait(1, A, timeout=30)
        r_at_anchor = s_rx.recv_state(1, R).nbytes
        assert a.ok
        # weighted: the residual progressed while the anchor was backlogged (never starved)
        assert r_at_anchor >= 0.1 * n, r_at_anchor
        assert s_rx.wait(1, R, timeout=30).ok
        assert np.array_equal(stage, src_arr)
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_strict_priority_anchor_overtakes_residual():
    rate = 100_000_000  # throttled sender: 100 MB/s, so timing is deterministic on loopback
    rx = Endpoint(name="rx")
    tx = Endpoint(name="tx", policy=PriorityPolicy(chunk_bytes=256 << 10),
                  backend_options={"_throttle_bps": rate})
    try:
        s_tx = tx.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        n_r, n_a = 40 * MiB, 8 * MiB
        stage = np.zeros(n_r + n_a, np.uint8)
        dst = rx.register(stage)
        src = tx.register(pattern(n_r + n_a, 5))
        s_rx.announce(1, {R: [(dst.id, 0, n_r)]})
        s_rx.announce(2, {A: [(dst.id, n_r, n_a)]})
        s_tx.wait_announcement(2, timeout=5)
        s_tx.write_stream(1, R, src, 0, n_r)
        s_tx.finish(1, R)
        while s_rx.recv_state(1, R).nbytes < 2 * MiB:  # the residual is mid-flight
            time.sleep(0.005)
        r_before = s_rx.recv_state(1, R).nbytes
        s_tx.write_stream(2, A, src, n_r, n_a)
        s_tx.finish(2, A)
        a = s_rx.wait(2, A, timeout=30)
        r_after = s_rx.recv_state(1, R)
        assert a.ok and r_after.status is Status.PENDING
        # a fair share would have moved ~n_a (8 MiB) residual bytes meanwhile; strict priority
        # only lets through the chunk that was partly sent when the anchor came (and on a loaded
        # machine one more that lands while the receiver still reads the anchor's tail)
        assert r_after.nbytes - r_before <= 2 * MiB, (r_before, r_after.nbytes)
        assert s_rx.wait(1, R, timeout=30).ok
        assert np.array_equal(stage, np.asarray(src.view))
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(30)
def test_secret_and_deadline():
    secret = b"s3cret, shared by the deployment"
    rx = Endpoint(name="rx", secret=secret)
    bad = Endpoint(name="bad", secret=b"wrong, but long enough too")
    none = Endpoint(name="none")
    good = Endpoint(name="good", secret=secret)
    try:
        # refused below the message layer (the control connections' CURVE is keyed by the
        # secret), and said so at once, not after connect's timeout
        for stranger, to in ((bad, rx), (none, rx), (good, none)):
            t0 = time.monotonic()
            with pytest.raises(HandshakeError, match="same secret"):
                stranger.connect(to.address, timeout=3)
            assert time.monotonic() - t0 < 2.0
        assert rx.stats()["handshakes_pending"] == 0
        s_tx = good.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        dst = rx.register(np.zeros(MiB, np.uint8))
        s_rx.announce(1, {A: [(dst.id, 0, MiB)]}, deadline_s=0.3)
        s_tx.wait_announcement(1, timeout=5)
        st = s_rx.wait(1, A, timeout=5)
        assert st.status is Status.FAILED and st.reason is FailureReason.TIMEOUT
        s_rx.release(1)
        rx.deregister(dst)
    finally:
        for ep in (good, none, bad, rx):
            ep.close()


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


@pytest.mark.timeout(60)
def test_close_joins_threads():
    before = {t.ident for t in threading.enumerate()}
    rx = Endpoint(name="rx")
    tx = Endpoint(name="tx")
    s_tx = tx.connect(rx.address, timeout=5)
    assert rx.accept(timeout=5) is not None
    assert s_tx.ready
    tx.close()
    rx.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, extra


@pytest.mark.timeout(60)
def test_crc32_used_when_peer_lacks_xxhash():
    corrupt = CorruptNext()
    rx = Endpoint(name="rx")
    tx = Endpoint(name="tx", backend_options={"_corrupt_checksum": corrupt})
    try:
        info = rx.backend.local_info()
        rx.backend.local_info = lambda: {**info, "checksums": ["crc32"]}  # an older/leaner peer
        s_tx = tx.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        assert tx.backend._sessions[s_tx.id].use_xxh3 is False
        stage = np.zeros(4 * MiB, np.uint8)
        dst = rx.register(stage)
        src_arr = pattern(4 * MiB, 9)
        src = tx.register(src_arr)
        s_rx.announce(1, {A: [(dst.id, 0, 2 * MiB)], R: [(dst.id, 2 * MiB, 2 * MiB)]})
        s_tx.wait_announcement(1, timeout=5)
        corrupt.arm(R)
        s_tx.write_stream(1, A, src, 0, 2 * MiB)
        s_tx.finish(1, A)
        s_tx.write_stream(1, R, src, 2 * MiB, 2 * MiB)
        s_tx.finish(1, R)
        assert s_rx.wait(1, A, timeout=10).ok
        assert np.array_equal(stage[:2 * MiB], src_arr[:2 * MiB])
        r = s_rx.wait(1, R, timeout=10)
        assert r.status is Status.FAILED and r.reason is FailureReason.CORRUPTION, r
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_progress_listener_wakes_a_consumer_on_every_change(pair):
    """`Endpoint.on_progress` lets the decode's applier block instead of polling: it fires when
    chunks land before the stream completes, at completion and at a failure; a listener that
    raises is counted and never breaks the data path."""
    rx, tx, s_rx, s_tx = pair
    calls: list[tuple[int, Status]] = []
    rx.on_progress(lambda: calls.append((s_rx.recv_state(9, A).nbytes, s_rx.recv_state(9, A).status)))
    n = 4 * MiB
    stage = np.zeros(n, np.uint8)
    dst, src = rx.register(stage), tx.register(pattern(n, 9))
    s_rx.announce(9, {A: [(dst.id, 0, n)]})
    s_tx.wait_announcement(9, timeout=5)
    s_tx.write_stream(9, A, src, 0, n)
    s_tx.finish(9, A)
    assert s_rx.wait(9, A, timeout=10).ok
    assert any(0 < landed < n for landed, _ in calls), calls  # woken mid-stream
    assert calls[-1] == (n, Status.COMPLETE)
    s_rx.release(9)
    s_tx.release(9)

    failed = threading.Event()
    rx.on_progress(lambda: failed.set() if s_rx.recv_state(10, R).status is Status.FAILED else None)
    s_rx.announce(10, {R: [(dst.id, 0, 1024)]})
    s_tx.wait_announcement(10, timeout=5)
    s_tx.abort(10, "test abort")
    assert failed.wait(10)
    s_rx.release(10)

    def broken():
        raise RuntimeError("listener bug")

    rx.on_progress(broken)
    s_rx.announce(11, {A: [(dst.id, 0, 1024)]})
    s_tx.wait_announcement(11, timeout=5)
    s_tx.write_stream(11, A, src, 0, 1024)
    s_tx.finish(11, A)
    assert s_rx.wait(11, A, timeout=10).ok
    assert rx.stats()["progress_listener_errors"] >= 1
