"""Loopback tests of lynx_transport's safety checks (tcp backend): writes outside the announced
ranges refused by the sender and, from a peer that skips its checks, by the receiver before any
byte lands; writes to unknown or released requests refused; a corrupt chunk fails its stream
(never completes it), also with the crc32 fallback for a peer without xxhash; a peer with another
secret (or none) refused at the handshake at once, and an announcement deadline failing a request
nothing was sent for. Each leaves the honest session working."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from session_pair import connected_pair, pattern

from lynx_transport import (
    Endpoint,
    FailureReason,
    HandshakeError,
    OutOfBoundsError,
    Status,
    Stream,
    UnknownRequestError,
    WriteOp,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
MiB = 1 << 20


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
