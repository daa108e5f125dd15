"""`ControlPlane`: the zmq control plane of one Endpoint, run by one thread.

Owns the control thread and what only it touches: the session table, the `Link` of each session,
the out-queue and wake-up socketpair through which other threads hand it outgoing messages, the
dispatch of every received message, heartbeats, the peer-timeout verdict and the deadline checks,
and the helper threads it or a session starts. Its sockets (CURVE, options, sending) are
`control_sockets.ControlSockets`'; the initiator's half of the handshake (HELLO, CHALLENGE or
REJECT, the end of its DEALER's ZMTP handshake) is `control_initiate.Initiator`'s, the acceptor's
(pending handshakes, their caps and pre-auth deadline, AUTH verification, bring-up)
`control_accept.Acceptor`'s.

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

import contextlib
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

from .auth import NONCE_BYTES
from .backend import Backend
from .control_accept import Acceptor
from .control_initiate import Initiator
from .control_sockets import ControlSockets, Link, peer_address
from .limits import Limits
from .types import FailureReason
from .wire import UNAUTHENTICATED, Envelope, Heartbeat, Message, WireError, decode, parse

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("lynx_transport")

# Messages taken from one socket per loop turn: a flood on one socket cannot hold off the
# heartbeats and deadline checks of every session.
RECV_BATCH = 256


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
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._count = count
        self._sockets = ControlSockets(host, port, secret=secret, limits=limits,
                                       heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                                       count=count)
        self.port = self._sockets.port
        self.address = self._sockets.address
        self._lock = threading.Lock()
        self._sessions: dict[bytes, Session] = {}  # read by any thread; changed under _lock
        self._links: dict[bytes, Link] = {}  # control thread only
        self._initiator = Initiator(self._sockets, secret=secret, endpoint_id=endpoint_id,
                                    backend_name=backend_name, count=count)
        self._acceptor = Acceptor(
            self._sockets, self._links, secret=secret, endpoint_id=endpoint_id, backend=backend,
            backend_name=backend_name, limits=limits, new_session=new_session, admit=self._admit,
            on_accepted=on_accepted, spawn=self.spawn, count=count)
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
    def session(self, sid: bytes) -> Session | None:
        return self._sessions.get(sid)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def handshakes_pending(self) -> int:
        """Acceptor handshakes answered with a CHALLENGE and not yet authenticated."""
        return self._acceptor.pending

    def _admit(self, link: Link) -> None:
        """Acceptor: the AUTH of `link`'s session proved the secret; its messages are ours now."""
        self._links[link.session.id] = link
        with self._lock:
            self._sessions[link.session.id] = link.session

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
        self._sockets.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ the control thread
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _loop(self) -> None:
        socks = self._sockets
        socks.poller.register(self._wake_r, zmq.POLLIN)
        last_hb = time.monotonic()
        try:
            while True:
                try:
                    events = dict(socks.poller.poll(20))
                except zmq.ZMQError:
                    break
                if self._wake_r.fileno() in events or events.get(self._wake_r):
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                if self._drain_outq():
                    break
                if socks.router in events:
                    self._receive(socks.router, None)
                for d, link in list(socks.dealers.items()):
                    if d in events:
                        self._receive(d, link)
                for m, link in list(socks.monitors.items()):
                    if m in events:
                        self._initiator.on_monitor(link)
                t = time.monotonic()
                if t - last_hb >= self._heartbeat_s:
                    last_hb = t
                    self._housekeeping(t)
                else:
                    self._check_deadlines(t)
        except Exception:  # pragma: no cover - a bug: every peer input is handled below
            log.exception("control loop crashed")
        finally:
            self._drain_outq(final=True)

    def _drain_outq(self, final: bool = False) -> bool:
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
                self._links[item.session.id] = self._initiator.open(item.session, item.address,
                                                                     item.nonce)
            elif isinstance(item, _Drop):
                link = self._links.pop(item.sid, None)
                if link is not None and link.dealer is not None:
                    self._sockets.close_dealer(link)
                with self._lock:
                    self._sessions.pop(item.sid, None)
            elif isinstance(item, _Send):
                link = self._links.get(item.sid)
                if link is not None:
                    self._sockets.transmit(link, item.message)

    def _receive(self, sock: zmq.Socket, link: Link | None) -> None:
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
            self._acceptor.on_hello(route, peer_address(frame), env)
            return
        link = self._links.get(env.sid)
        if link is None:
            if env.kind != "AUTH" or not self._acceptor.on_auth(route, env):
                self._count("control_unknown_session")
            return
        if link.route != route:
            self._count("control_wrong_route")
            return
        self._deliver(link, env)

    def _on_dealt(self, link: Link, frames: list[bytes]) -> None:
        try:
            env = decode(frames)
        except WireError:
            self._count("control_malformed")
            return
        if env.sid != link.session.id:
            self._count("control_wrong_route")
            return
        if env.kind in UNAUTHENTICATED:
            self._initiator.on_reply(link, env)
        else:
            self._deliver(link, env)

    def _deliver(self, link: Link, env: Envelope) -> None:
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

    # ------------------------------------------------------------------ liveness and deadlines
    def _housekeeping(self, t: float) -> None:
        self._acceptor.expire(t)
        for s in self.sessions():
            if s.closed:
                continue
            link = self._links.get(s.id)
            if link is not None and s.wants_heartbeats:
                self._sockets.transmit(link, Heartbeat())
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
