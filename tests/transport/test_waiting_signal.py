"""The receiver's WAITING (`Session.mark_waiting`, `lynx_transport.link_order` rule 6): its frame
and field checks (`wire`), the round trip on loopback tcp (the signal arrives, and the link
order takes that Residual ahead of a newer Anchor then and not before; with no signal a
request announced with `signals_waiting` is not promoted by the sender's guess), and the
hostile cases: a WAITING for an unknown, finished or not-signalling request, a repeat and
malformed frames are dropped and counted, and the session goes on serving.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
from session_pair import pattern, wait_until

from lynx_transport import Endpoint, PriorityPolicy, Stream
from lynx_transport.wire import (
    MAX_WAITING_HEADER_BYTES,
    Announce,
    Message,
    Waiting,
    WireError,
    decode,
    encode,
    parse,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
MiB = 1 << 20
SID = bytes(range(16))


@dataclass(frozen=True)
class _Forged(Message):
    """A WAITING with whatever header a hostile peer puts in it (MACed like any message)."""

    KIND: ClassVar[str] = "WAITING"
    fields: dict = field(default_factory=dict)
    extra: bytes = b""

    @property
    def payload(self) -> bytes:
        return self.extra

    def header(self) -> dict:
        return self.fields


def test_waiting_frame_and_fields():
    assert parse(decode(encode("WAITING", SID, {"req": 2**64 - 1}))) == Waiting(2**64 - 1)
    for header, payload in (({"req": -1}, b""), ({"req": 2**64}, b""), ({"req": "7"}, b""),
                            ({"req": True}, b""), ({}, b""), ({"req": 7, "x": 1}, b""),
                            ({"req": 7}, b"x"),  # no payload
                            ({"req": 7, "pad": "a" * MAX_WAITING_HEADER_BYTES}, b"")):
        with pytest.raises(WireError):
            parse(decode(encode("WAITING", SID, header, payload)))
    # the size is checked on the frame, before its JSON is parsed
    with pytest.raises(WireError, match="WAITING"):
        decode([b"WAITING", b"[" * (MAX_WAITING_HEADER_BYTES + 1), b""])


def test_announce_carries_the_promise():
    msg = parse(decode(encode("ANNOUNCE", SID, {"req": 1, "bounds": {}, "waits": True})))
    assert isinstance(msg, Announce) and msg.waits and msg.announcement().signals_waiting
    old = parse(decode(encode("ANNOUNCE", SID, {"req": 1, "bounds": {}})))  # an older decode
    assert not old.waits and not old.announcement().signals_waiting
    with pytest.raises(WireError):
        parse(decode(encode("ANNOUNCE", SID, {"req": 1, "bounds": {}, "waits": 1})))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signal", [True, False])
def test_loopback_waiting_promotes_the_residual_then(signal):
    """Request 1 (announced with `signals_waiting`) has its Anchor delivered; 0.6 s later its
    Residual (0.1 s of wire) is queued just after request 2's Anchor (0.5 s). By the sender's
    guess it is late already (its byte bound passed), but its receiver signals: without a
    WAITING it stays behind the newer Anchor; with one, sent 0.15 s in, it goes first once it
    has waited as long as what is left of that Anchor (rule 4), and not before the WAITING."""
    rate = 20_000_000  # throttled sender: the link's rate, deterministic on loopback
    rx = Endpoint(name="rx")
    tx = Endpoint(name="tx", policy=PriorityPolicy(chunk_bytes=256 << 10, link_order=True),
                  backend_options={"_throttle_bps": rate})
    try:
        s_tx = tx.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        n_a1, n_r1, n_a2 = 6 * MiB, 2 * MiB, 10 * MiB  # 6 MiB: the link's rate is measured
        total = n_a1 + n_r1 + n_a2
        stage = np.zeros(total, np.uint8)
        dst = rx.register(stage)
        src = tx.register(pattern(total, 11))
        s_rx.announce(1, {A: [(dst.id, 0, n_a1)], R: [(dst.id, n_a1, n_r1)]},
                      signals_waiting=True)
        s_rx.announce(2, {A: [(dst.id, n_a1 + n_r1, n_a2)]})
        s_tx.wait_announcement(2, timeout=5)
        s_tx.write_stream(1, A, src, 0, n_a1)
        s_tx.finish(1, A)
        assert s_rx.wait(1, A, timeout=10).ok
        time.sleep(0.6)
        s_tx.write_stream(2, A, src, n_a1 + n_r1, n_a2)
        s_tx.finish(2, A)
        s_tx.write_stream(1, R, src, n_a1, n_r1)
        s_tx.finish(1, R)
        t_signal = None
        if signal:
            time.sleep(0.15)
            t_signal = time.monotonic()
            assert s_rx.mark_waiting(1)
            assert not s_rx.mark_waiting(1)  # once per request
        r1 = s_rx.wait(1, R, timeout=30)
        a2 = s_rx.wait(2, A, timeout=30)
        assert r1.ok and a2.ok
        assert (r1.t_done < a2.t_done) is signal, (r1.t_done, a2.t_done)
        if signal:
            assert r1.t_first_byte > t_signal  # promoted by the WAITING, not before it
            assert tx.stats().get("waiting_taken") == 1
        assert np.array_equal(stage, np.asarray(src.view))
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_hostile_waitings_are_dropped_and_counted():
    """From an authenticated peer: WAITINGs for a request never sent, one announced without
    `signals_waiting`, one whose Residual is complete, a repeat, and malformed ones (a field
    too many, an id out of range, a payload, an oversized header) change nothing but the
    counters, and the session goes on serving."""
    rx = Endpoint(name="rx")
    tx = Endpoint(name="tx", policy=PriorityPolicy(link_order=True))
    try:
        s_tx = tx.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        stage = np.zeros(6 * 4096, np.uint8)
        dst = rx.register(stage)
        src = tx.register(pattern(stage.size, 3))

        def announce(rid: int, at: int, signals: bool) -> None:
            s_rx.announce(rid, {A: [(dst.id, at, 4096)], R: [(dst.id, at + 4096, 4096)]},
                          signals_waiting=signals)
            s_tx.wait_announcement(rid, timeout=5)

        def send(rid: int, at: int, stream: Stream) -> None:
            s_tx.write_stream(rid, stream, src, at + 4096 * int(stream), 4096)
            s_tx.finish(rid, stream)
            assert s_rx.wait(rid, stream, timeout=10).ok

        announce(1, 0, signals=True)
        announce(2, 8192, signals=False)
        announce(3, 16384, signals=False)
        send(1, 0, A)
        send(2, 8192, A)
        send(3, 16384, A)
        send(2, 8192, R)
        assert s_tx.wait_sent(2, R, timeout=10).ok
        send_raw = s_rx._send  # a peer that skips mark_waiting's own checks
        send_raw(Waiting(77))  # never sent
        send_raw(Waiting(2))  # announced without signals_waiting, and finished
        send_raw(Waiting(3))  # announced without signals_waiting
        send_raw(_Forged({"req": 1, "x": 1}))
        send_raw(_Forged({"req": -1}))
        send_raw(_Forged({"req": 1}, b"x"))
        send_raw(_Forged({"req": 1, "pad": "a" * 4096}))
        send_raw(Waiting(1))
        send_raw(Waiting(1))  # a repeat
        stats = tx.stats
        wait_until(lambda: stats().get("waiting_dropped_duplicate") == 1, 5, "the repeat")
        got = stats()
        assert got.get("waiting_taken") == 1
        assert got.get("waiting_dropped_unknown") == 1
        assert got.get("waiting_dropped_finished") == 1  # its Residual is complete
        assert got.get("waiting_dropped_unannounced") == 1
        assert got.get("control_malformed") == 4
        # the session serves on: request 1's Residual, and a WAITING too late for it
        send(1, 0, R)
        send(3, 16384, R)
        assert s_tx.wait_sent(1, R, timeout=10).ok
        send_raw(Waiting(1))
        wait_until(lambda: stats().get("waiting_dropped_finished") == 2, 5, "the late one")
        assert not s_rx.mark_waiting(1)  # complete here: nothing to wait on
        assert not s_rx.mark_waiting(2)  # not announced with signals_waiting
        assert not s_rx.mark_waiting(99)  # never announced
        assert s_tx.ready and s_rx.ready
        assert np.array_equal(stage, np.asarray(src.view))
    finally:
        tx.close()
        rx.close()


def test_waiting_header_cap_fits_the_largest_honest_one():
    frames = encode("WAITING", bytes([255]) * 16, Waiting(2**64 - 1).header())
    assert len(frames[1]) <= MAX_WAITING_HEADER_BYTES
    assert json.loads(frames[1])["req"] == 2**64 - 1
