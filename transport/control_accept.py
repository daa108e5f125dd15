"""`Acceptor`: the acceptor's half of the control-plane handshake, up to a session it hands over.

Owns the handshakes this endpoint answered with a CHALLENGE and whose AUTH has not come (`Pending`:
no thread and no backend resource until the AUTH proved the secret), their admission (the
per-address HELLO rate, `Limits.max_handshakes` and `max_handshakes_per_peer` with eviction, the
pre-auth deadline `Limits.auth_timeout_s`), the AUTH verification, the WELCOME, and the bounded
bring-up threads (`Limits.max_bring_ups`) that connect an accepted session's data path.

Everything it is given comes from an unauthenticated peer. Called by the control thread
(`control.ControlPlane`: `on_hello`, `on_auth`, `expire`) and, for `pending`, by `Endpoint.stats`
through it; it sends through `control_sockets.ControlSockets` and registers the sessions it accepts
with the control plane through `admit`.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .auth import NONCE_BYTES, Channel, SessionKeys
from .backend import Backend
from .control_sockets import ControlSockets, Link
from .limits import Limits, RateLimiter
from .types import FailureReason
from .wire import Auth, Challenge, Envelope, Hello, Reject, VersionMismatch, Welcome, WireError

if TYPE_CHECKING:
    from .session import Session


@dataclass
class Pending:
    """A HELLO answered with a CHALLENGE, waiting for the initiator's AUTH."""

    route: bytes
    peer: str  # the peer's IP address, for the per-peer cap
    hello: Hello
    keys: SessionKeys
    deadline: float


class Acceptor:
    """HELLO → CHALLENGE → AUTH → WELCOME and the bring-up, on the control thread's behalf."""

    def __init__(
        self,
        sockets: ControlSockets,
        links: Mapping[bytes, Link],
        *,
        secret: bytes,
        endpoint_id: str,
        backend: Backend,
        backend_name: str,
        limits: Limits,
        new_session: Callable[[bytes, bool, str], Session],
        admit: Callable[[Link], None],
        on_accepted: Callable[[Session], None],
        spawn: Callable[[Callable[[], None], str], None],
        count: Callable[[str], None],
    ) -> None:
        self._sockets = sockets
        self._links = links  # the control plane's, read here to count the sessions open
        self._secret = secret
        self._endpoint_id = endpoint_id
        self._backend = backend
        self._backend_name = backend_name
        self._limits = limits
        self._new_session = new_session
        self._admit = admit
        self._on_accepted = on_accepted
        self._spawn = spawn
        self._count = count
        self._hello_rate = RateLimiter(limits.hello_rate, limits.hello_burst)
        self._sessions_full = f"busy: {limits.max_sessions} sessions open (Limits.max_sessions)"
        self._pending: dict[bytes, Pending] = {}  # control thread only
        self._lock = threading.Lock()
        self._bring_ups = 0  # under _lock: a bring-up thread ends on its own

    @property
    def pending(self) -> int:
        """Handshakes answered with a CHALLENGE and not yet authenticated."""
        return len(self._pending)

    def on_hello(self, route: bytes, peer: str, env: Envelope) -> None:
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
            self._evict(peer)
        while len(self._pending) >= min(lim.max_handshakes, lim.max_sessions - len(self._links)):
            self._evict(None)
        nonce = os.urandom(NONCE_BYTES)
        keys = SessionKeys.derive(self._secret, env.sid, hello.nonce, nonce)
        self._pending[env.sid] = Pending(route, peer, hello, keys, t + lim.auth_timeout_s)
        self._sockets.send_unauthenticated(route, env.sid, Challenge(self._endpoint_id, nonce))

    def _evict(self, peer: str | None) -> None:
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
        self._sockets.send_unauthenticated(route, sid, Reject("busy: too many handshakes in "
                                                              "progress; retry"))

    def expire(self, t: float) -> None:
        """Forget the pending handshakes whose AUTH did not come by their deadline."""
        for sid in [sid for sid, p in self._pending.items() if t > p.deadline]:
            del self._pending[sid]
            self._count("handshake_expired")

    def on_auth(self, route: bytes, env: Envelope) -> bool:
        """An AUTH for session `env.sid`; False if no handshake of that id is pending."""
        pending = self._pending.get(env.sid)
        if pending is None:
            return False
        if pending.route != route:  # someone else naming this handshake: the real one goes on
            self._count("control_wrong_route")
            return True
        del self._pending[env.sid]
        channel = Channel(pending.keys, initiator=False)
        if channel.check(env.signed, env.auth) is not None:
            self._count("handshake_auth_failed")
            self._reject(route, env.sid, "authentication failed: the two endpoints do not share "
                                         "the same secret (or one has none)")
            return True
        try:
            auth = Auth.parse(env.header, env.payload)
        except WireError as exc:
            self._reject(route, env.sid, f"malformed AUTH: {exc}")
            return True
        if len(self._links) >= self._limits.max_sessions:  # filled since its HELLO
            self._reject(route, env.sid, self._sessions_full)
            return True
        with self._lock:
            busy = self._bring_ups >= self._limits.max_bring_ups
            self._bring_ups += not busy
        if busy:
            self._reject(route, env.sid, "busy: too many sessions being brought up; retry")
            return True
        try:
            prepare = self._backend.session_prepare(env.sid, False, pending.keys.data)
        except Exception as exc:
            self._bring_up_done()
            self._reject(route, env.sid, f"backend prepare failed: {exc}")
            return True
        s = self._new_session(env.sid, False, pending.hello.address)
        s.peer_endpoint_id = pending.hello.endpoint
        s.data_key = pending.keys.data
        s.remote_info = auth.info
        s.remote_prepare = auth.prepare
        s.local_prepare = prepare
        link = Link(s, route=route, channel=channel)
        self._admit(link)
        self._sockets.transmit(link, Welcome(self._backend.local_info(), prepare))
        self._spawn(functools.partial(self._bring_up, s), f"lynx-accept-{s.id.hex()[:6]}")
        return True

    def _reject(self, route: bytes, sid: bytes, reason: str) -> None:
        self._count("handshake_rejected")
        self._sockets.send_unauthenticated(route, sid, Reject(reason))

    def _bring_up_done(self) -> None:
        with self._lock:
            self._bring_ups -= 1

    def _bring_up(self, s: Session) -> None:
        """Connect the data path, exchange READY, hand the session to `accept()`."""
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
