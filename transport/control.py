"""`ControlPlane`: the zmq control plane of one Endpoint, run by one thread.

Owns every zmq socket (a ROUTER bound at the endpoint's address; one DEALER per session this
endpoint initiated, watched through a zmq monitor until its ZMTP handshake ends) and their CURVE
layer when the endpoint has a secret (keyed by it: a peer without it completes no handshake, so
libzmq buffers nothing it sends), the link of each session (`_Link`: the connection its messages
must arrive on and its message authentication), the acceptor's half of the handshake (HELLO
admission, CHALLENGE, AUTH verification, WELCOME, the bounded bring-up threads; `_Pending`
handshakes), the out-queue and wake-up socketpair through which other threads hand it outgoing
messages, heartbeats, the peer-timeout verdict and the deadline checks, and the helper threads it
or a session starts.

Every message a peer sends passes one gate before a Session sees it: framing (`wire.decode`), the
route (a session's messages must arrive on the connection the session was opened on), the MAC
and sequence number (`auth.Channel`), then the fields (`wire.parse`). A message failing any check
is counted in `Endpoint.stats()` and dropped; a handler that raises is counted and logged. One
peer's bad message never stops the thread that serves the others.

Called by the Endpoint (construction, `open` in connect, `sessions`, `stop`/`close`) and by
sessions (`send`, `forget`, `spawn`, `stopped`: `sessionbase.SessionControl`). What a message means
is the Session's business (`Session.on_message`); message formats are `lynx_transport.wire`'s,
keys and MACs `lynx_transport.auth`'s, the caps `lynx_transport.limits`'.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .auth import NO_SECRET, NONCE_BYTES, Channel, SessionKeys, control_key
from .backend import Backend
from .limits import Limits, RateLimiter
from .types import FailureReason
from .wire import (
    UNAUTHENTICATED,
    Auth,
    Challenge,
    Envelope,
    Heartbeat,
    Hello,
    Message,
    Reject,
    VersionMismatch,
    Welcome,
    WireError,
    decode,
    encode,
    parse,
)

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("lynx_transport")

# IP TOS of the control plane (heartbeats, announcements, completion notices, acks): "minimize
# delay", which Linux maps to socket priority 6, the ANCHOR's band in a priority qdisc. Unmarked,
# control messages sat in a lower band than the ANCHOR (EF, priority 6): on a 10 Mbit/s link an
# ANCHOR of 8 s starved the sender's heartbeats, and the receiver declared the live peer dead.
CONTROL_TOS = 0x10
# Messages taken from one socket per loop turn: a flood on one socket cannot hold off the
# heartbeats and deadline checks of every session.
RECV_BATCH = 256
# CURVE carries each frame in a MESSAGE command (name, nonce, flags and MAC: 33 B more): the frame
# cap leaves room for that around the largest legitimate frame.
CURVE_FRAME_OVERHEAD = 64
# What an initiator's DEALER reports until its control connection is up: a ZMTP handshake the peer
# fails (another secret; CURVE against none) is otherwise retried in silence until connect's
# timeout.
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_DISCONNECTED)


@dataclass
class _Link:
    """How one session's messages travel and are authenticated. The route is fixed when the
    session is created: a message naming the session on any other connection is dropped."""

    session: Session
    route: bytes | None = None  # acceptor: the peer's ROUTER routing id
    dealer: zmq.Socket | None = None  # initiator: the session's own DEALER
    monitor: zmq.Socket | None = None  # initiator: the DEALER's events until its handshake ends
    nonce: bytes = b""  # initiator: its HELLO nonce, needed when the CHALLENGE comes
    channel: Channel | None = None  # None until both nonces are known


@dataclass
class _Pending:
    """Acceptor: a HELLO answered with a CHALLENGE, waiting for the initiator's AUTH. Holds no
    thread and no backend resource: those come only after the AUTH proved the secret."""

    route: bytes
    peer: str  # the peer's IP address, for the per-peer cap
    hello: Hello
    keys: SessionKeys
    deadline: float


# Work items of the out-queue (only the control thread touches sockets).
@dataclass(frozen=True)
class _Open:
    session: Session
    address: str
    nonce: bytes


@dataclass(frozen=True)
class _Drop:
    sid: bytes


@dataclass(frozen=True)
class _Send:
    sid: bytes
    message: Message


class _Stop:
    pass


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:  # a transport without addresses (inproc, ipc)
        return ""


class ControlPlane:
    """The control plane; `start()` runs its thread, `stop()` then `close()` end it."""

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        *,
        secret: bytes,
        endpoint_id: str,
        backend: Backend,
        backend_name: str,
        limits: Limits,
        heartbeat_s: float,
        peer_timeout_s: float,
        new_session: Callable[[bytes, bool, str], Session],
        on_accepted: Callable[[Session], None],
        count: Callable[[str], None],
    ) -> None:
        self._secret = secret
        self._endpoint_id = endpoint_id
        self._backend = backend
        self._backend_name = backend_name
        self._limits = limits
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._new_session = new_session
        self._on_accepted = on_accepted
        self._count = count
        self._hello_rate = RateLimiter(limits.hello_rate, limits.hello_burst)
        self._sessions_full = f"busy: {limits.max_sessions} sessions open (Limits.max_sessions)"
        self._curve: tuple[bytes, bytes] | None = None  # the CURVE server's (public, secret) key
        if secret != NO_SECRET:
            if not zmq.has("curve"):
                raise RuntimeError("an Endpoint with a secret needs a libzmq with CURVE support "
                                   "for its control connections (pyzmq's wheels have it)")
            key = z85.encode(control_key(secret))
            self._curve = (zmq.curve_public(key), key)
        self._ctx = zmq.Context()
        self._router = self._socket(zmq.ROUTER)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._lock = threading.Lock()
        self._sessions: dict[bytes, Session] = {}  # read by any thread; changed under _lock
        self._links: dict[bytes, _Link] = {}  # control thread only, as are the two below
        self._dealer_links: dict[zmq.Socket, _Link] = {}
        self._monitors: dict[zmq.Socket, _Link] = {}
        self._pending: dict[bytes, _Pending] = {}
        self._bring_ups = 0  # under _lock
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"lynx-ctrl-{name}", daemon=True)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.TOS, CONTROL_TOS)
        # A frame larger than this closes the peer's connection before zmq allocates it.
        overhead = CURVE_FRAME_OVERHEAD if self._curve is not None else 0
        sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes + overhead)
        if kind == zmq.ROUTER:
            # A connection that has not finished its ZMTP handshake (with CURVE: proven the
            # secret) by then is closed: an idle one holds an fd and zmq's buffers no longer.
            sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(self._limits.auth_timeout_s * 1000)))
            # A ROUTER cannot close one peer's connection, and a half-open peer (stopped, or
            # behind a cut link) never closes its own: libzmq drops a connection whose peer
            # answers no ZMTP PING for peer_timeout_s, after our own verdict on its sessions.
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self._heartbeat_s * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self._peer_timeout_s * 1000)))
        if self._curve is not None:
            # CURVE below the message layer: without the secret a peer cannot complete the
            # handshake, so it cannot make libzmq buffer a single frame (ZMQ_MAXMSGSIZE bounds one
            # frame, not how many frames an unfinished multipart message has)
            public, secret = self._curve
            if kind == zmq.ROUTER:
                sock.curve_server = True
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            else:
                sock.curve_serverkey = public
                # the acceptor checks no client key: knowing its public key proves the secret
                sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        return sock

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ session table
    def session(self, sid: bytes) -> Session | None:
        return self._sessions.get(sid)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def handshakes_pending(self) -> int:
        """Acceptor handshakes answered with a CHALLENGE and not yet authenticated."""
        return len(self._pending)

    # ------------------------------------------------------------------ for sessions / Endpoint
    @property
    def stopped(self) -> bool:
        return self._stopped

    def send(self, sid: bytes, message: Message, *, force: bool = False) -> None:
        """Queue `message` to the peer of session `sid` (any thread); it is MACed when sent. After
        `stop()` only a `force`d one is queued."""
        if self._stopped and not force:
            return
        self._outq.put(_Send(sid, message))
        self._wake()

    def open(self, s: Session, address: str) -> None:
        """Initiator: open session `s`'s DEALER to `address` and send its HELLO."""
        with self._lock:
            self._sessions[s.id] = s
        self._outq.put(_Open(s, address, os.urandom(NONCE_BYTES)))
        self._wake()

    def forget(self, sid: bytes) -> None:
        """A session closed: drop its socket and table entry."""
        if not self._stopped:
            self._outq.put(_Drop(sid))
            self._wake()

    def spawn(self, target: Callable[[], None], name: str) -> None:
        """Run `target` on a daemon thread that `stop()` joins."""
        t = threading.Thread(target=target, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        t.start()

    def stop(self, timeout: float) -> None:
        """Stop the control thread, then join the threads it spawned (each up to `timeout`)."""
        self._stopped = True
        self._outq.put(_Stop())
        self._wake()
        self._thread.join(timeout)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)

    def close(self) -> None:
        """Close every socket (after `stop()`)."""
        with contextlib.suppress(Exception):
            self._router.close(0)
            for d in self._dealer_links:
                d.close(0)
            for m in self._monitors:
                m.close(0)
            self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ the control thread
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_hb = time.monotonic()
        try:
            while True:
                try:
                    events = dict(poller.poll(20))
                except zmq.ZMQError:
                    break
                if self._wake_r.fileno() in events or events.get(self._wake_r):
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                if self._drain_outq(poller):
                    break
                if self._router in events:
                    self._receive(self._router, None)
                for d, link in list(self._dealer_links.items()):
                    if d in events:
                        self._receive(d, link)
                for m, link in list(self._monitors.items()):
                    if m in events:
                        self._on_monitor(link, poller)
                t = time.monotonic()
                if t - last_hb >= self._heartbeat_s:
                    last_hb = t
                    self._housekeeping(t)
                else:
                    self._check_deadlines(t)
        except Exception:  # pragma: no cover - a bug: every peer input is handled below
            log.exception("control loop crashed")
        finally:
            self._drain_outq(poller, final=True)

    def _drain_outq(self, poller: zmq.Poller, final: bool = False) -> bool:
        """Carry out the queued work; True if a stop was among it."""
        stop = False
        while True:
            try:
                item = self._outq.get_nowait()
            except queue.Empty:
                return stop
            if isinstance(item, _Stop):
                stop = True
            elif isinstance(item, _Open) and not final:
                d = self._socket(zmq.DEALER)
                link = _Link(item.session, dealer=d, nonce=item.nonce)
                link.monitor = d.get_monitor_socket(
                    HANDSHAKE_EVENTS, addr=f"inproc://lynx-ctrl-{item.session.id.hex()}")
                self._monitors[link.monitor] = link
                poller.register(link.monitor, zmq.POLLIN)
                d.connect(item.address)
                self._links[item.session.id] = link
                self._dealer_links[d] = link
                poller.register(d, zmq.POLLIN)
                hello = Hello(self._backend_name, self._endpoint_id, self.address, item.nonce)
                with contextlib.suppress(zmq.ZMQError):
                    d.send_multipart(encode(hello.KIND, item.session.id, hello.header()),
                                     zmq.NOBLOCK)
            elif isinstance(item, _Drop):
                link = self._links.pop(item.sid, None)
                if link is not None and link.dealer is not None:
                    self._unmonitor(link, poller)
                    self._dealer_links.pop(link.dealer, None)
                    with contextlib.suppress(Exception):
                        poller.unregister(link.dealer)
                    link.dealer.close(100)
                with self._lock:
                    self._sessions.pop(item.sid, None)
            elif isinstance(item, _Send):
                link = self._links.get(item.sid)
                if link is not None:
                    self._transmit(link, item.message)

    def _transmit(self, link: _Link, message: Message) -> None:
        if link.channel is None:  # the session's keys are not known yet: nothing may be sent
            self._count("control_unsent_no_key")
            return
        frames = encode(message.KIND, link.session.id, message.header(), message.payload)
        frames.append(link.channel.seal(frames))
        try:
            if link.dealer is not None:
                link.dealer.send_multipart(frames, zmq.NOBLOCK)
            else:
                self._router.send_multipart([link.route, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control send %s failed: %s", message.KIND, exc)

    def _send_unauthenticated(self, route: bytes, sid: bytes, message: Message) -> None:
        frames = encode(message.KIND, sid, message.header(), message.payload)
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([route, *frames], zmq.NOBLOCK)

    def _receive(self, sock: zmq.Socket, link: _Link | None) -> None:
        """Take up to RECV_BATCH messages from the ROUTER (`link` None) or a session's DEALER."""
        for _ in range(RECV_BATCH):
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [p.bytes for p in parts]
            try:
                if link is None:
                    self._on_routed(frames[0], parts[-1], frames[1:])
                else:
                    self._on_dealt(link, frames)
            except Exception:  # pragma: no cover - a bug; the message is lost, the loop goes on
                log.exception("control message handling failed")
                self._count("control_handler_error")

    def _on_routed(self, route: bytes, frame: zmq.Frame, frames: list[bytes]) -> None:
        try:
            env = decode(frames)
        except WireError:
            self._count("control_malformed")
            return
        if env.kind == "HELLO":
            self._on_hello(route, _peer_address(frame), env)
            return
        link = self._links.get(env.sid)
        if link is None:
            pending = self._pending.get(env.sid)
            if pending is not None and env.kind == "AUTH":
                self._on_auth(route, pending, env)
            else:
                self._count("control_unknown_session")
            return
        if link.route != route:
            self._count("control_wrong_route")
            return
        self._deliver(link, env)

    def _on_dealt(self, link: _Link, frames: list[bytes]) -> None:
        try:
            env = decode(frames)
        except WireError:
            self._count("control_malformed")
            return
        if env.sid != link.session.id:
            self._count("control_wrong_route")
            return
        if env.kind in UNAUTHENTICATED:
            self._on_handshake_reply(link, env)
        else:
            self._deliver(link, env)

    def _deliver(self, link: _Link, env: Envelope) -> None:
        """Authenticate, parse and dispatch one message of an established link."""
        s = link.session
        problem = "no_key" if link.channel is None else link.channel.check(env.signed, env.auth)
        if problem is not None:
            self._count(f"control_{problem}")
            if problem == "bad_mac" and s.initiator and not s.welcomed:
                s.refused("the peer could not authenticate: the two endpoints do not share the "
                          "same secret (or one has none)")
            return
        try:
            message = parse(env)
        except WireError as exc:
            self._count("control_malformed")
            log.debug("malformed %s on session %s: %s", env.kind, s.id.hex()[:8], exc)
            return
        if message is None:
            self._count("control_unknown_kind")
        try:
            s.on_message(message)
        except Exception:
            log.exception("control message %s failed", env.kind)
            self._count("control_handler_error")

    # ------------------------------------------------------------------ initiator handshake
    def _on_handshake_reply(self, link: _Link, env: Envelope) -> None:
        """CHALLENGE or REJECT on an initiator's DEALER: heeded only before the WELCOME."""
        s = link.session
        if s.welcomed or env.kind == "HELLO" or (link.channel is not None and env.kind != "REJECT"):
            self._count("control_unexpected")
            return
        try:
            message = parse(env)
        except VersionMismatch as exc:
            s.refused(str(exc))
            return
        except WireError:
            self._count("control_malformed")
            return
        if isinstance(message, Reject):
            s.refused(message.reason)
        elif isinstance(message, Challenge):
            keys = SessionKeys.derive(self._secret, s.id, link.nonce, message.nonce)
            link.channel = Channel(keys, initiator=True)
            s.challenged(keys.data, message.endpoint)

    def _on_monitor(self, link: _Link, poller: zmq.Poller) -> None:
        """The ZMTP handshake of a session's control connection ended: up, or failed (the peer
        closed it: with CURVE keyed by the secret, that is what another secret or none does)."""
        while link.monitor is not None:
            try:
                event = parse_monitor_message(link.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.session.refused("the control connection's handshake failed: the two "
                                     "endpoints do not share the same secret (or one has none)")
            self._unmonitor(link, poller)

    def _unmonitor(self, link: _Link, poller: zmq.Poller) -> None:
        m = link.monitor
        if m is None:
            return
        link.monitor = None
        del self._monitors[m]
        with contextlib.suppress(KeyError):
            poller.unregister(m)
        with contextlib.suppress(zmq.ZMQError):
            link.dealer.disable_monitor()
        m.close(0)

    # ------------------------------------------------------------------ acceptor handshake
    def _on_hello(self, route: bytes, peer: str, env: Envelope) -> None:
        if env.sid in self._links or env.sid in self._pending:
            self._count("hello_duplicate")
            return
        t = time.monotonic()
        if not self._hello_rate.allow(peer, t):
            self._count("hello_rate_limited")  # unanswered: answering would cost as much
            return
        try:
            hello = Hello.parse(env.header, env.payload)
        except VersionMismatch as exc:
            self._reject(route, env.sid, str(exc))
            return
        except WireError:
            self._count("control_malformed")
            return
        lim = self._limits
        if hello.backend != self._backend_name:
            self._reject(route, env.sid, f"backend {hello.backend!r} != {self._backend_name!r}")
            return
        if len(self._links) >= lim.max_sessions:
            self._reject(route, env.sid, self._sessions_full)
            return
        # The pre-authentication budget is never full for a newcomer: refusing it would let
        # unanswered HELLOs from a few addresses lock every honest peer out
        if sum(p.peer == peer for p in self._pending.values()) >= lim.max_handshakes_per_peer:
            self._evict_pending(peer)
        while len(self._pending) >= min(lim.max_handshakes, lim.max_sessions - len(self._links)):
            self._evict_pending(None)
        nonce = os.urandom(NONCE_BYTES)
        keys = SessionKeys.derive(self._secret, env.sid, hello.nonce, nonce)
        self._pending[env.sid] = _Pending(route, peer, hello, keys, t + lim.auth_timeout_s)
        self._send_unauthenticated(route, env.sid, Challenge(self._endpoint_id, nonce))

    def _evict_pending(self, peer: str | None) -> None:
        """Drop one pending handshake (the oldest of address `peer`, or with None the oldest of the
        address holding the most) and tell its initiator, which may retry."""
        if peer is None:
            held = collections.Counter(p.peer for p in self._pending.values())
            most = max(held.values())
            sid = next(sid for sid, p in self._pending.items() if held[p.peer] == most)
        else:
            sid = next(sid for sid, p in self._pending.items() if p.peer == peer)
        route = self._pending.pop(sid).route
        self._count("handshake_evicted")
        self._send_unauthenticated(route, sid, Reject("busy: too many handshakes in progress; "
                                                      "retry"))

    def _on_auth(self, route: bytes, pending: _Pending, env: Envelope) -> None:
        if pending.route != route:  # someone else naming this handshake: the real one goes on
            self._count("control_wrong_route")
            return
        del self._pending[env.sid]
        channel = Channel(pending.keys, initiator=False)
        if channel.check(env.signed, env.auth) is not None:
            self._count("handshake_auth_failed")
            self._reject(route, env.sid, "authentication failed: the two endpoints do not share "
                                         "the same secret (or one has none)")
            return
        try:
            auth = Auth.parse(env.header, env.payload)
        except WireError as exc:
            self._reject(route, env.sid, f"malformed AUTH: {exc}")
            return
        if len(self._links) >= self._limits.max_sessions:  # filled since its HELLO
            self._reject(route, env.sid, self._sessions_full)
            return
        with self._lock:
            busy = self._bring_ups >= self._limits.max_bring_ups
            self._bring_ups += not busy
        if busy:
            self._reject(route, env.sid, "busy: too many sessions being brought up; retry")
            return
        try:
            prepare = self._backend.session_prepare(env.sid, False, pending.keys.data)
        except Exception as exc:
            self._bring_up_done()
            self._reject(route, env.sid, f"backend prepare failed: {exc}")
            return
        s = self._new_session(env.sid, False, pending.hello.address)
        s.peer_endpoint_id = pending.hello.endpoint
        s.remote_info = auth.info
        s.remote_prepare = auth.prepare
        s.local_prepare = prepare
        link = _Link(s, route=route, channel=channel)
        self._links[s.id] = link
        with self._lock:
            self._sessions[s.id] = s
        self._transmit(link, Welcome(self._backend.local_info(), prepare))
        self.spawn(functools.partial(self._bring_up, s), f"lynx-accept-{s.id.hex()[:6]}")

    def _reject(self, route: bytes, sid: bytes, reason: str) -> None:
        self._count("handshake_rejected")
        self._send_unauthenticated(route, sid, Reject(reason))

    def _bring_up_done(self) -> None:
        with self._lock:
            self._bring_ups -= 1

    def _bring_up(self, s: Session) -> None:
        """Acceptor: connect the data path, exchange READY, hand the session to `accept()`."""
        timeout = self._limits.handshake_timeout_s
        try:
            self._backend.session_connect(s.id, s.remote_info, s.remote_prepare, False, timeout)
            s.data_path_up()
            if s.wait_peer_ready(time.monotonic() + timeout):
                self._on_accepted(s)
            elif not s.closed:
                s.terminate(FailureReason.CLOSED, "peer never ready", True)
        except Exception as exc:
            s.terminate(FailureReason.CLOSED, f"data path failed: {exc}", True)
        finally:
            self._bring_up_done()

    # ------------------------------------------------------------------ liveness and deadlines
    def _housekeeping(self, t: float) -> None:
        for sid in [sid for sid, p in self._pending.items() if t > p.deadline]:
            del self._pending[sid]
            self._count("handshake_expired")
        for s in self.sessions():
            if s.closed:
                continue
            link = self._links.get(s.id)
            if link is not None and s.wants_heartbeats:
                self._transmit(link, Heartbeat())
            if s.ready and t - s.last_heard > self._peer_timeout_s:
                s.terminate(FailureReason.PEER_DIED,
                            f"no control message for {t - s.last_heard:.1f} s", notify=True)
        self._check_deadlines(t)

    def _check_deadlines(self, t: float) -> None:
        for s in self.sessions():
            try:
                s.check_deadlines(t)
            except Exception:  # pragma: no cover - a bug in one session must not stop the others
                log.exception("deadline check of session %s failed", s.id.hex()[:8])
