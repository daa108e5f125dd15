"""`ControlPlane`: the zmq control plane of one Endpoint, run by one thread.

Owns every zmq socket (a ROUTER bound at the endpoint's address; one DEALER per session this
endpoint initiated), the session table that routes incoming messages, the out-queue and wake-up
socketpair through which other threads hand it outgoing messages, the acceptor side of the
handshake (HELLO check, REJECT, WELCOME, the bring-up thread), heartbeats, the peer-timeout verdict
and the deadline checks, and the helper threads it or a session starts.

Called by the `Endpoint` (construction, `add_session`/`dial` in connect, `sessions`, `stop`/`close`)
and by sessions (`send`, `forget`, `spawn`, `stopped`: `sessionbase.SessionControl`). What a
message means is the Session's business (`Session.on_message`); what a well-formed message or
HELLO is, is `lynx_transport.wire`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from .backend import Backend
from .types import FailureReason
from .wire import ControlMessage, Hello, LocalIdentity, check_hello, decode, encode

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("lynx_transport")

# IP TOS of the control plane (heartbeats, announcements, completion notices, acks): "minimize
# delay", which Linux maps to socket priority 6, the ANCHOR's band in a priority qdisc. Unmarked,
# control messages sat in a lower band than the ANCHOR (EF, priority 6): on a 10 Mbit/s link an
# ANCHOR of 8 s starved the sender's heartbeats, and the receiver declared the live peer dead.
CONTROL_TOS = 0x10
# The acceptor has no caller's timeout: how long it gives a peer's data path and READY.
BRING_UP_TIMEOUT_S = 10.0


# Work items of the out-queue (only the control thread touches sockets).
@dataclass(frozen=True)
class _Dial:
    sid: bytes
    address: str


@dataclass(frozen=True)
class _Drop:
    sid: bytes


@dataclass(frozen=True)
class _Send:
    sid: bytes
    kind: str
    header: dict
    payload: bytes


class _Stop:
    pass


class ControlPlane:
    """The control plane; `start()` runs its thread, `stop()` then `close()` end it."""

    def __init__(
        self,
        host: str,
        port: int,
        name: str,
        *,
        identity: LocalIdentity,
        backend: Backend,
        heartbeat_s: float,
        peer_timeout_s: float,
        new_session: Callable[[bytes, bool, str], Session],
        on_accepted: Callable[[Session], None],
        count: Callable[[str], None],
    ) -> None:
        self._identity = identity
        self._backend = backend
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._new_session = new_session
        self._on_accepted = on_accepted
        self._count = count
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.TOS, CONTROL_TOS)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._lock = threading.Lock()
        self._sessions: dict[bytes, Session] = {}
        self._routes: dict[bytes, bytes] = {}  # acceptor side: sid → the peer's ROUTER identity
        self._dealers: dict[bytes, zmq.Socket] = {}  # initiator side: sid → DEALER
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"lynx-ctrl-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ session table
    def add_session(self, s: Session) -> None:
        with self._lock:
            self._sessions[s.id] = s

    def session(self, sid: bytes) -> Session | None:
        return self._sessions.get(sid)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    # ------------------------------------------------------------------ for sessions / Endpoint
    @property
    def stopped(self) -> bool:
        return self._stopped

    def send(self, sid: bytes, kind: str, header: dict, payload: bytes = b"", *,
             force: bool = False) -> None:
        """Queue a message to the peer of session `sid` (any thread). After `stop()` only a
        `force`d one is queued."""
        if self._stopped and not force:
            return
        header = dict(header)
        header["sid"] = sid.hex()
        self._outq.put(_Send(sid, kind, header, payload))
        self._wake()

    def dial(self, sid: bytes, address: str) -> None:
        """Initiator: open session `sid`'s DEALER to `address` (the HELLO sent next wakes the
        control thread to do it)."""
        self._outq.put(_Dial(sid, address))

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
            for d in self._dealers.values():
                d.close(0)
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
                    self._receive(self._router, routed=True)
                for d in list(self._dealers.values()):
                    if d in events:
                        self._receive(d, routed=False)
                t = time.monotonic()
                if t - last_hb >= self._heartbeat_s:
                    last_hb = t
                    self._housekeeping(t)
                else:
                    self._check_deadlines(t)
        except Exception:  # pragma: no cover - logged, endpoint unusable
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
            elif isinstance(item, _Dial) and not final:
                d = self._ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.TOS, CONTROL_TOS)
                d.connect(item.address)
                self._dealers[item.sid] = d
                poller.register(d, zmq.POLLIN)
            elif isinstance(item, _Drop):
                d = self._dealers.pop(item.sid, None)
                if d is not None:
                    with contextlib.suppress(Exception):
                        poller.unregister(d)
                    d.close(100)
                with self._lock:
                    self._sessions.pop(item.sid, None)
                    self._routes.pop(item.sid, None)
            elif isinstance(item, _Send):
                self._transmit(item)

    def _transmit(self, item: _Send) -> None:
        frames = encode(item.kind, item.header, item.payload)
        try:
            d = self._dealers.get(item.sid)
            if d is not None:
                d.send_multipart(frames, zmq.NOBLOCK)
            else:
                route = self._routes.get(item.sid)
                if route is not None:
                    self._router.send_multipart([route, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control send %s failed: %s", item.kind, exc)

    def _receive(self, sock: zmq.Socket, routed: bool) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if routed:
                self._on_frames(frames[0], frames[1:])
            else:
                self._on_frames(None, frames)

    def _on_frames(self, route: bytes | None, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        msg = decode(frames)
        if msg is None:
            self._count("control_garbage")
            return
        if msg.kind == "HELLO":
            self._on_hello(route, msg)
            return
        s = self._sessions.get(msg.sid)
        if s is None:
            return
        try:
            s.on_message(msg.kind, msg.header, msg.payload)
        except Exception:
            log.exception("control message %s failed", msg.kind)

    # ------------------------------------------------------------------ acceptor handshake
    def _on_hello(self, route: bytes | None, msg: ControlMessage) -> None:
        if route is None or msg.sid in self._sessions:
            return  # a HELLO to an initiator's DEALER, or a duplicate
        hello = Hello.from_header(msg.header)
        problem = check_hello(hello, self._identity)
        if problem is None:
            try:
                prepare = self._backend.session_prepare(msg.sid, False)
            except Exception as exc:
                problem = f"backend prepare failed: {exc}"
        if problem is not None:
            self._reject(route, msg.sid, problem)
            return
        s = self._new_session(msg.sid, False, hello.address)
        s.peer_endpoint_id = hello.endpoint
        s.remote_info = hello.info
        s.remote_prepare = hello.prepare
        s.local_prepare = prepare
        with self._lock:
            self._routes[s.id] = route
            self._sessions[s.id] = s
        self.send(s.id, "WELCOME", {"info": self._backend.local_info(), "prepare": prepare,
                                    "endpoint": self._identity.endpoint_id})
        self.spawn(functools.partial(self._bring_up, s), f"lynx-accept-{s.id.hex()[:6]}")

    def _reject(self, route: bytes, sid: bytes, reason: str) -> None:
        # straight onto the ROUTER: the rejected peer has no session to queue for
        self._count("handshake_rejected")
        frames = encode("REJECT", {"sid": sid.hex(), "reason": reason})
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([route, *frames], zmq.NOBLOCK)

    def _bring_up(self, s: Session) -> None:
        """Acceptor: connect the data path, exchange READY, hand the session to `accept()`."""
        try:
            self._backend.session_connect(s.id, s.remote_info, s.remote_prepare, False,
                                          BRING_UP_TIMEOUT_S)
            s.data_path_up()
            if s.wait_peer_ready(time.monotonic() + BRING_UP_TIMEOUT_S):
                self._on_accepted(s)
            elif not s.closed:
                s.terminate(FailureReason.CLOSED, "peer never ready", True)
        except Exception as exc:
            s.terminate(FailureReason.CLOSED, f"data path failed: {exc}", True)

    # ------------------------------------------------------------------ liveness and deadlines
    def _housekeeping(self, t: float) -> None:
        for s in self.sessions():
            if s.closed:
                continue
            if s.wants_heartbeats:
                self.send(s.id, "HB", {})
            if s.ready and t - s.last_heard > self._peer_timeout_s:
                s.terminate(FailureReason.PEER_DIED,
                            f"no control message for {t - s.last_heard:.1f} s", notify=True)
        self._check_deadlines(t)

    def _check_deadlines(self, t: float) -> None:
        for s in self.sessions():
            s.check_deadlines(t)
