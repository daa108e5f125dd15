"""Control-plane messages without sockets: framing and the HELLO check (`lynx_transport.wire`), and
a Session's message handlers driven through `Session.on_message` with stand-in links."""

from __future__ import annotations

import pytest

from lynx_transport import FailureReason, Session, Stream, UnknownRequestError
from lynx_transport.wire import (
    PROTOCOL_VERSION,
    Hello,
    LocalIdentity,
    announce_header,
    check_hello,
    decode,
    encode,
    make_hello,
    parse_announce,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
LOCAL = LocalIdentity("ep-local", "tcp", b"secret")


def test_frames_roundtrip_and_garbage():
    msg = decode(encode("ACK", {"sid": "ab01", "req": 7}, b"xy"))
    assert msg is not None
    assert (msg.kind, msg.sid, msg.header["req"], msg.payload) == ("ACK", b"\xab\x01", 7, b"xy")
    assert decode(encode("HB", {"sid": "ab01"})).payload == b""
    assert decode([b"HB", b"not json"]) is None
    assert decode([b"HB", b'{"no_sid": 1}']) is None
    assert decode([b"HB", b'{"sid": "zz"}']) is None


def test_check_hello():
    peer = LocalIdentity("ep-peer", "tcp", b"secret")
    hello = make_hello(peer, {"port": 1}, {"nonce": "00"}, "tcp://h:1")
    assert Hello.from_header(hello.to_header()) == hello
    assert check_hello(hello, LOCAL) is None
    assert check_hello(make_hello(LocalIdentity("p", "tcp", b"wrong"), {}, {}, ""), LOCAL) == "bad token"
    assert check_hello(make_hello(LocalIdentity("p", "tcp", None), {}, {}, ""), LOCAL) == "bad token"
    assert "backend 'verbs'" in check_hello(make_hello(LocalIdentity("p", "verbs", b"secret"),
                                                       {}, {}, ""), LOCAL)
    old = Hello.from_header({**hello.to_header(), "version": PROTOCOL_VERSION + 1})
    assert "protocol version" in check_hello(old, LOCAL)
    # without a local token any peer token is accepted
    assert check_hello(hello, LocalIdentity("ep-local", "tcp", None)) is None


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

    def __init__(self):
        self.backend = _Backend()
        self.counters: dict[str, int] = {}

    def region(self, rid):
        raise AssertionError("not used")

    def find_region(self, rid):
        return None

    def region_refs(self, rids, delta):
        pass

    def count(self, key, n=1):
        self.counters[key] = self.counters.get(key, 0) + n


class _Control:
    stopped = False

    def __init__(self):
        self.sent: list[tuple[str, dict]] = []

    def send(self, sid, kind, header, payload=b"", *, force=False):
        self.sent.append((kind, header))

    def forget(self, sid):
        pass

    def spawn(self, target, name):
        target()


def _session() -> tuple[Session, _Control]:
    control = _Control()
    return Session(_Host(), control, b"\x01" * 16, True, "tcp://peer:1"), control


def test_session_handshake_messages():
    s, _ = _session()
    assert not s.wants_heartbeats and not s.wait_welcome(0.0)
    s.on_message("WELCOME", {"info": {"port": 2}, "prepare": {"nonce": "ff"}, "endpoint": "e"}, b"")
    assert s.wait_welcome(0.0) and s.wants_heartbeats
    assert (s.remote_info, s.remote_prepare, s.peer_endpoint_id) == ({"port": 2}, {"nonce": "ff"},
                                                                      "e")
    s.data_path_up()
    assert not s.ready
    s.on_message("READY", {}, b"")
    assert s.ready and s.wait_peer_ready(0.0)
    heard = s.last_heard
    s.on_message("NO-SUCH-KIND", {}, b"")  # a newer peer's message: ignored, but proves liveness
    assert s.last_heard >= heard and not s.closed
    r, _ = _session()
    r.on_message("REJECT", {"reason": "bad token"}, b"")
    assert r.wait_welcome(0.0) and r.handshake_error == "bad token"


def test_session_announce_release_and_bye():
    s, control = _session()
    header = {"req": 9, "bounds": {"0": [[3, 0, 100]], "1": [[3, 100, 50]]}, "deadline_in": 30}
    s.on_message("ANNOUNCE", announce_header(parse_announce(header, b"m"), 30.0), b"m")
    ann = s.announcement(9)
    assert ann is not None and ann.meta == b"m" and ann.deadline is not None
    assert ann.stream_nbytes(A) == 100 and ann.stream_nbytes(R) == 50
    # a fenced RELEASE: the sender drains the request, then answers RELEASED
    s.on_message("RELEASE", {"req": 9, "fence": True}, b"")
    assert ("RELEASED", {"req": 9}) in control.sent
    assert s.wait_announcement(9, timeout=0) is ann  # still there, but no longer live:
    with pytest.raises(UnknownRequestError, match="no \\(live\\) announcement"):
        s.finish(9, A)
    s.on_message("BYE", {"reason": "closed", "detail": "bye"}, b"")
    assert s.closed and s.close_reason is FailureReason.PEER_DIED
    assert s.close_detail == "peer closed the session: bye"
