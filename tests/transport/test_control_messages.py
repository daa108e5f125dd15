"""Control-plane messages without sockets: framing and the typed messages (`lynx_transport.wire`),
and a Session's message handlers driven through `Session.on_message` with stand-in links."""

from __future__ import annotations

import json

import pytest

from lynx_transport import (
    Announcement,
    Extent,
    FailureReason,
    Limits,
    Session,
    Stream,
    UnknownRequestError,
)
from lynx_transport.auth import AUTH_BYTES
from lynx_transport.types import MAX_EXTENTS
from lynx_transport.wire import (
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Announce,
    Bye,
    Hello,
    Nack,
    Ready,
    Release,
    Released,
    VersionMismatch,
    Welcome,
    WireError,
    decode,
    encode,
    parse,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
SID = bytes(range(16))


def _frames(kind: str, header: dict, payload: bytes = b"") -> list[bytes]:
    return [kind.encode(), json.dumps({"sid": SID.hex(), **header}).encode(), payload]


def test_frames_roundtrip_and_garbage():
    env = decode(encode("ACK", SID, {"req": 7, "stream": 1, "nbytes": 3}, b"xy"))
    assert (env.kind, env.sid, env.header["req"], env.payload, env.auth) == ("ACK", SID, 7, b"xy",
                                                                             None)
    assert parse(env) == Ack(7, R, 3)
    assert decode([*encode("HB", SID, {}), b"\0" * AUTH_BYTES]).auth == b"\0" * AUTH_BYTES
    for bad in ([b"HB", b"{}"],  # two frames
                [b"HB", b"not json", b""],
                [b"HB", b"[1, 2]", b""],  # not an object
                [b"HB", b'{"no_sid": 1}', b""],
                [b"HB", b'{"sid": "zz"}', b""],
                [b"HB", json.dumps({"sid": "ab" * 15}).encode(), b""],  # 15 bytes
                [b"hb", encode("HB", SID, {})[1], b""],  # kind: upper case only
                [b"H" * 17, encode("HB", SID, {})[1], b""],
                [b"\xff", encode("HB", SID, {})[1], b""],
                [*encode("HB", SID, {}), b"short auth"],
                [b"HB", encode("HB", SID, {})[1], b"x" * (64 * 1024 + 1)],  # payload cap
                [b"HB", b" " * (MAX_HEADER_BYTES + 1), b""],
                [b"HB", b"[" * 100_000, b""],  # nesting: RecursionError inside json
                [b"HB", json.dumps({"sid": SID.hex(), "x": float("nan")}).encode(), b""]):
        with pytest.raises(WireError):
            decode(bad)


def test_typed_messages_check_every_field():
    def parsed(kind, header, payload=b""):
        return parse(decode(_frames(kind, header, payload)))

    nonce = "ab" * 32
    hello = parsed("HELLO", {"version": PROTOCOL_VERSION, "backend": "tcp", "nonce": nonce})
    assert hello == Hello("tcp", "", "?", bytes.fromhex(nonce))
    with pytest.raises(VersionMismatch, match=f"protocol version 1 != {PROTOCOL_VERSION}"):
        parsed("HELLO", {"version": 1, "backend": "tcp", "token": "zz"})  # a v1 peer
    for bad in ({"version": "2", "backend": "tcp", "nonce": nonce},
                {"version": PROTOCOL_VERSION, "backend": 5, "nonce": nonce},
                {"version": PROTOCOL_VERSION, "backend": "tcp", "nonce": "zz" * 32},
                {"version": PROTOCOL_VERSION, "backend": "tcp", "nonce": nonce[:-2]},
                # the right length, but fromhex would skip the spaces: the fuzzer's find
                {"version": PROTOCOL_VERSION, "backend": "tcp", "nonce": "ab " + nonce[3:]},
                {"version": PROTOCOL_VERSION, "backend": "tcp", "nonce": nonce.upper()},
                {"version": PROTOCOL_VERSION, "backend": "tcp", "nonce": nonce,
                 "address": "a" * 10_000}):
        with pytest.raises(WireError):
            parsed("HELLO", bad)
    assert parsed("ABORT", {"req": 3, "stream": None, "reason": "from-the-future"}) == Abort(
        3, None, FailureReason.ABORTED)  # an unknown reason: the kind's default
    assert parsed("BYE", {}) == Bye(FailureReason.CLOSED)
    assert parsed("RELEASE", {"req": 2**64 - 1, "fence": True}) == Release(2**64 - 1, True)
    for kind, bad in (("ACK", {"req": -1, "stream": 0, "nbytes": 0}),
                      ("ACK", {"req": 2**64, "stream": 0, "nbytes": 0}),
                      ("ACK", {"req": True, "stream": 0, "nbytes": 0}),  # a bool is no int
                      ("ACK", {"req": 1, "stream": 2, "nbytes": 0}),
                      ("NACK", {"req": 1, "stream": "0"}),
                      ("NACK", {"req": 1, "stream": 0, "reason": ["x"]}),
                      ("RELEASE", {"req": 1, "fence": "yes"}),
                      ("RELEASED", {}),
                      ("WELCOME", {"info": [], "prepare": {}}),
                      ("WELCOME", {"info": {"k": {"nested": 1}}, "prepare": {}}),
                      ("WELCOME", {"info": {f"k{i}": i for i in range(100)}, "prepare": {}}),
                      ("AUTH", {"info": {}, "prepare": {"q": list(range(100))}})):
        with pytest.raises(WireError):
            parsed(kind, bad)
    assert parsed("FUTURE", {}) is None  # a newer peer's kind: ignored


def test_announce_roundtrip_and_caps():
    ann = Announcement(9, {A: (Extent(3, 0, 100),), R: (Extent(3, 100, 50), Extent(4, 0, 1))},
                       meta=b"m", targets={A: ({"addr": 1, "rkey": 2},), R: ({}, {})})
    msg = Announce.of(ann, 30.0)
    env = decode(encode(msg.KIND, SID, msg.header(), msg.payload))
    got = parse(env)
    assert got == msg
    rec = got.announcement()
    assert rec.bounds == ann.bounds and rec.targets == ann.targets and rec.meta == b"m"
    assert rec.deadline is not None and rec.find(A, 3, 10, 20) == (Extent(3, 0, 100),
                                                                   {"addr": 1, "rkey": 2})

    def announce(bounds, **extra):
        return parse(decode(_frames("ANNOUNCE", {"req": 1, "bounds": bounds, **extra})))

    for bad in ({"2": []},  # no such stream
                {"0": [[1, 0, 10]]},  # target missing
                {"0": [[1, -1, 10, {}]]},
                {"0": [[2**32, 0, 10, {}]]},  # region ids are u32
                {"0": [[1, 2**64 - 5, 10, {}]]},  # ends beyond 2**64
                {"0": [[1, 0, 10, {}]] * 1025},  # MAX_EXTENTS
                {"0": "all of it"}):
        with pytest.raises(WireError):
            announce(bad)
    for bad in (-1, "soon", 1e12):
        with pytest.raises(WireError):
            announce({}, deadline_in=bad)


# ------------------------------------------------------------------ Session with stand-in links
class _Backend:
    def __init__(self):
        self.drained: list[tuple[int, float]] = []

    def drain(self, sid, request_id, timeout, stream=None):
        self.drained.append((request_id, timeout))
        return True

    def session_close(self, sid):
        pass


class _Host:
    backend_counts_incoming = True
    checksum = True
    default_deadline_s = None
    unsafe_skip_bounds = False

    def __init__(self, limits: Limits | None = None):
        self.backend = _Backend()
        self.limits = limits or Limits()
        self.counters: dict[str, int] = {}

    def region(self, rid):
        raise AssertionError("not used")

    def find_region(self, rid):
        return None

    def region_refs(self, rids, delta):
        pass

    def count(self, key, n=1):
        self.counters[key] = self.counters.get(key, 0) + n

    def progress(self):
        self.counters["progress"] = self.counters.get("progress", 0) + 1


class _Control:
    stopped = False

    def __init__(self):
        self.sent: list = []

    def send(self, sid, message, *, force=False):
        self.sent.append(message)

    def forget(self, sid):
        pass

    def spawn(self, target, name):
        target()


def _session(**host) -> tuple[Session, _Control, _Host]:
    control, h = _Control(), _Host(**host)
    return Session(h, control, SID, True, "tcp://peer:1"), control, h


def _announce(req: int) -> Announce:
    return Announce(req, {A: (Extent(3, 0, 100),)}, {A: ({},)}, 30.0, b"m")


def test_session_handshake_messages():
    s, control, _ = _session()
    assert not s.wants_heartbeats and not s.wait_challenge(0.0) and not s.wait_welcome(0.0)
    s.challenged(b"k" * 32, "ep-peer")
    assert s.wait_challenge(0.0) and s.data_key == b"k" * 32 and s.peer_endpoint_id == "ep-peer"
    s.authenticate({"port": 1}, {"q": 1})
    assert s.local_prepare == {"q": 1} and control.sent[-1].KIND == "AUTH"
    s.on_message(Welcome({"port": 2}, {"nonce": "ff"}))
    assert s.wait_welcome(0.0) and s.wants_heartbeats and s.welcomed
    assert (s.remote_info, s.remote_prepare) == ({"port": 2}, {"nonce": "ff"})
    s.on_message(Welcome({"port": 666}, {}))  # a second WELCOME changes nothing
    assert s.remote_info == {"port": 2}
    s.data_path_up()
    assert not s.ready and isinstance(control.sent[-1], Ready)
    s.on_message(Ready())
    assert s.ready and s.wait_peer_ready(0.0)
    heard = s.last_heard
    s.on_message(None)  # a newer peer's kind: ignored, but proves liveness
    assert s.last_heard >= heard and not s.closed
    r, _, _ = _session()
    r.refused("authentication failed")
    r.refused("a later reason does not replace the first")
    assert r.wait_challenge(0.0) and r.handshake_error == "authentication failed"


def test_session_handshake_order():
    """The handshake state moves only along its transitions: a READY before the WELCOME changes
    nothing; the acceptor starts welcomed and takes the peer's READY before its own data path."""
    s, _, _ = _session()
    s.challenged(b"k" * 32, "ep-peer")
    s.on_message(Ready())  # out of order: no honest acceptor sends it before its WELCOME
    s.on_message(Welcome({"port": 2}, {}))
    s.data_path_up()
    assert not s.ready and not s.wait_peer_ready(0.0)
    s.on_message(Ready())
    assert s.ready
    acceptor = Session(_Host(), _Control(), SID, False, "tcp://peer:1")
    assert acceptor.welcomed and acceptor.wants_heartbeats
    acceptor.on_message(Ready())  # the initiator's READY may come before this side's data path
    assert not acceptor.ready
    acceptor.data_path_up()
    assert acceptor.ready
    early, _, _ = _session()
    with pytest.raises(RuntimeError, match="handshake state NEW"):
        early.data_path_up()  # a bug: the data path cannot be up before the WELCOME


def test_session_announce_release_and_bye():
    s, control, _ = _session()
    s.on_message(_announce(9))
    ann = s.announcement(9)
    assert ann is not None and ann.meta == b"m" and ann.deadline is not None
    assert ann.stream_nbytes(A) == 100
    # a fenced RELEASE of a request with nothing in flight: answered RELEASED at once
    s.on_message(Release(9, fence=True))
    assert Released(9) in control.sent
    assert s.wait_announcement(9, timeout=0) is ann  # still there, but no longer live:
    with pytest.raises(UnknownRequestError, match="no \\(live\\) announcement"):
        s.finish(9, A)
    # RELEASE of requests never announced does not grow the session's state
    for req in range(1000, 1100):
        s.on_message(Release(req))
    assert list(s._peer_released) == [9]
    s.on_message(Bye(FailureReason.CLOSED, "bye"))
    assert s.closed and s.close_reason is FailureReason.PEER_DIED
    assert s.close_detail == "peer closed the session: bye"


def test_pending_announcements_are_capped():
    s, control, host = _session(limits=Limits(max_peer_announcements=3))
    for req in range(5):
        s.on_message(_announce(req))
    assert [s.announcement(r) is not None for r in range(5)] == [True] * 3 + [False] * 2
    aborts = [m for m in control.sent if isinstance(m, Abort)]
    assert [m.request_id for m in aborts] == [3, 4]
    assert "max_peer_announcements" in aborts[0].detail
    assert host.counters["peer_announcements_refused"] == 2
    s.on_message(_announce(1))  # a known request may be announced again
    s.release(0)  # released here: its place is free
    s.on_message(_announce(3))
    assert s.announcement(3) is not None
    s.on_message(Release(1))  # released by the peer: no longer live, so its place is free too
    s.on_message(_announce(4))
    assert s.announcement(4) is not None
    t, _, _ = _session(limits=Limits(max_peer_announcements=3))
    for req in range(10):  # the released ones kept are bounded as well, oldest dropped first
        t.on_message(_announce(req))
        t.on_message(Release(req))
    assert list(t._peer_released) == [7, 8, 9] and set(t._peer_ann) == {7, 8, 9}


def _large_announce(req: int) -> Announce:
    """The largest ANNOUNCE the parser takes: MAX_EXTENTS extents per stream, verbs-like targets."""
    bounds = {st: tuple(Extent(3, i * 64, 64) for i in range(MAX_EXTENTS)) for st in (A, R)}
    targets = {st: tuple({"addr": 2**40 + i, "rkey": 7} for i in range(MAX_EXTENTS)) for st in (A, R)}
    return Announce(req, bounds, targets, 30.0, b"m")


def test_pending_announcements_have_a_memory_budget():
    """One maximum-size ANNOUNCE holds ~0.9 MiB on the sender: under the count cap alone (4096 a
    session) an authenticated peer could make it hold ~3.6 GiB. The byte budget refuses the excess,
    forgets released ones first, and gives the bytes back when a request is released here."""
    one = _large_announce(0).announcement().footprint
    assert 0.7 * 2**20 < one < 1.2 * 2**20  # the calibrated estimate, near what tracemalloc saw
    s, control, host = _session(limits=Limits(max_peer_announcement_bytes=3 * one + 100))
    for req in range(5):
        s.on_message(_large_announce(req))
    assert [s.announcement(r) is not None for r in range(5)] == [True] * 3 + [False] * 2
    aborts = [m for m in control.sent if isinstance(m, Abort)]
    assert [m.request_id for m in aborts] == [3, 4]
    assert "max_peer_announcement_bytes" in aborts[0].detail
    assert host.counters["peer_announcements_refused"] == 2
    assert s._peer_ann_bytes == 3 * one
    s.on_message(Release(1))  # released by the peer, kept for late writes: forgotten first
    s.on_message(_large_announce(3))
    assert s.announcement(3) is not None and s.announcement(1) is None
    s.release(0)  # released here: its bytes are given back
    assert s._peer_ann_bytes == 2 * one
    for req in range(100, 200):  # small ones still fit beside the large ones
        s.on_message(_announce(req))
    assert all(s.announcement(r) is not None for r in range(100, 200))


def test_released_only_for_a_fence_we_wait_for():
    s, _, _ = _session()
    for req in range(100):
        s.on_message(Released(req))
    assert s._fences == {}


def test_nack_and_abort_of_unknown_requests_are_harmless():
    s, _, _ = _session()
    s.on_message(Nack(5, A, FailureReason.CORRUPTION, "x"))
    s.on_message(Abort(6, None, FailureReason.ABORTED, "y"))
    s.on_message(Ack(7, R, 10))
    assert not s.closed
