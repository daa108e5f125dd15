"""`Session`: one connection to a peer Endpoint, its request state and its control messages.

A Session owns everything per peer that is not a socket: its handshake state, its receiver role
(`receiver.ReceiverRole`: what it announced, what landed), its sender role (`sender.SenderRole`:
the peer's announcements, what it posted), its close state, and how each control message from
the peer changes them (`on_message`, a table of its own handlers keyed by message type). The
control plane has authenticated and parsed every message it is given (`lynx_transport.wire`).

Called by users (the public API), by the `Endpoint` (connect's handshake, close), by the
`ControlPlane` (`on_message`, heartbeats, peer timeout, `check_deadlines`, the acceptor's
handshake) and by the backend hooks (`open_incoming`, `incoming_fin`, `on_sent`, `abort_request`,
`terminate`). It reaches its Endpoint only through `sessionbase.SessionHost` and the control plane
only through `sessionbase.SessionControl`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from .handshake import Handshake, HandshakeEvent
from .receiver import ReceiverRole
from .sender import SenderRole
from .sessionbase import SessionControl, SessionHost, now
from .types import FailureReason, Stream
from .wire import (
    Abort,
    Ack,
    Announce,
    Auth,
    Bye,
    Heartbeat,
    Message,
    Nack,
    Ready,
    Release,
    Released,
    Waiting,
    Welcome,
)

log = logging.getLogger("lynx_transport")


class Session(ReceiverRole, SenderRole):
    """A connection to one peer Endpoint. Either side may announce (receive) and write (send).

    Receiver-side methods: `announce`, `recv_state`, `wait`, `mark_waiting`, `release`.
    Sender-side methods: `announcement`, `wait_announcement`, `write`, `write_stream`, `finish`,
    `send_state`, `wait_sent`, `abort`, `release`.
    All are thread-safe and non-blocking except the `wait*` methods and `release` (bounded).
    """

    def __init__(self, host: SessionHost, control: SessionControl, sid: bytes, initiator: bool,
                 peer_address: str):
        super().__init__(host, control, sid, initiator, peer_address)
        self._handlers: dict[type[Message], Callable[[Any], None]] = {
            Welcome: self._on_welcome,
            Ready: self._on_ready,
            Heartbeat: self._on_heartbeat,
            Bye: self._on_bye,
            Announce: self._on_announce,
            Release: self._on_release,
            Released: self._on_released,
            Ack: self._on_ack,
            Nack: self._on_nack,
            Abort: self._on_abort,
            Waiting: self._on_waiting,
        }

    def __repr__(self) -> str:
        role = "initiator" if self.initiator else "acceptor"
        return f"<Session {self.id.hex()[:8]} {role} peer={self.peer_address} ready={self.ready}>"

    def close(self) -> None:
        """Close this session (peer sees BYE → its requests fail CLOSED)."""
        self.terminate(FailureReason.CLOSED, "closed locally", notify=True)

    def abort(self, request_id: int, reason: str = "aborted by user") -> None:
        """Fail every pending stream of `request_id` on both sides (either role)."""
        self.abort_request(request_id, None, FailureReason.ABORTED, reason, notify=True)

    def release(self, request_id: int, timeout: float = 2.0) -> None:
        """Forget `request_id` on this session, in whichever roles this side has for it.

        Receiver role: the announced bounds are withdrawn; when release returns, no further byte
        lands in them (a chunk landing at that moment is waited for, at most one socket read; with
        a one-sided backend such as verbs, release waits for the sender's drain reply), so the
        staging memory may be reused. Pending streams fail RELEASED and the sender is told.
        Sender role: queued writes are dropped; when release returns, no source byte of the
        request will be read again, so the source memory may be reused or freed.
        If that cannot be guaranteed within `timeout` s (stalled link), the session is closed.
        """
        with self._lock:
            rq = self._take_rx(request_id)
            tq = self._take_tx(request_id)
        if rq is not None:
            self._release_rx(request_id, rq, timeout)
        if tq is not None:
            self._release_tx(request_id, tq, timeout)
        self._notify()

    # ============================================ transport-internal interface (not for users)
    # ---- lifecycle (Endpoint, ControlPlane, backend hooks)
    def terminate(self, reason: FailureReason, detail: str, notify: bool) -> None:
        """Close the session for `reason`: fail its pending streams in both roles, tear down its
        data path and control socket; tell the peer (BYE) if `notify`. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            self.close_detail = detail
        if notify and not self._control.stopped:
            self._send(Bye(reason, detail), force=True)
        with self._lock:
            rx_ids, tx_ids = self._rx_ids(), self._tx_ids()
        for rid in rx_ids:
            self._rx_fail(rid, None, reason, detail, notify=False)
        for rid in tx_ids:
            self._tx_fail(rid, None, reason, detail)
        with contextlib.suppress(Exception):
            self._host.backend.session_close(self.id)
        self._control.forget(self.id)
        self._notify()
        log.debug("session %s closed: %s %s", self.id.hex()[:8], reason.value, detail)

    def abort_request(self, request_id: int, stream: Stream | None, reason: FailureReason,
                      detail: str, notify: bool) -> None:
        """Fail `request_id`'s pending streams (all, or `stream`) in both roles, dropping the
        sender's queued ops; `notify`: tell the peer (ABORT)."""
        self._rx_fail(request_id, stream, reason, detail, notify=False)
        if self._tx_fail(request_id, stream, reason, detail):
            with contextlib.suppress(Exception):
                self._drain(request_id, 0.0, stream)
        if notify and not self.closed:
            self._send(Abort(request_id, stream, reason, detail))

    def check_deadlines(self, t: float) -> None:
        """Fail (TIMEOUT, both sides) every request past its deadline with streams pending."""
        if self.closed:
            return
        with self._lock:
            expired_rx, expired_tx = self._rx_expired(t), self._tx_ids(expired_at=t)
        for rid, why in expired_rx:
            self.abort_request(rid, None, FailureReason.TIMEOUT,
                               f"receiver deadline passed ({why})", notify=True)
        for rid in expired_tx:
            self.abort_request(rid, None, FailureReason.TIMEOUT, "sender deadline passed",
                               notify=True)

    # ---- handshake (Endpoint.connect on the initiator, ControlPlane on the acceptor)
    @property
    def welcomed(self) -> bool:
        """The peer's backend info is known: the initiator got its WELCOME; always on the acceptor
        (the initiator's AUTH carried it)."""
        return self._handshake.welcomed

    @property
    def wants_heartbeats(self) -> bool:
        """The initiator heartbeats only after WELCOME: until then the acceptor does not know the
        session (it learns of it from the AUTH)."""
        return self.welcomed or not self.initiator

    def challenged(self, data_key: bytes, peer_endpoint: str) -> None:
        """Initiator: the acceptor's CHALLENGE came; the session's keys are known."""
        with self._cond:
            if self._advance(HandshakeEvent.CHALLENGE):
                self.data_key = data_key
                self.peer_endpoint_id = peer_endpoint

    def refused(self, reason: str) -> None:
        """Initiator: the handshake failed (REJECT, another protocol version, a peer that could not
        authenticate); `connect` raises with `reason`."""
        with self._cond:
            if self.handshake_error is None:
                self.handshake_error = reason
            self._cond.notify_all()

    def authenticate(self, info: dict, prepare: dict) -> None:
        """Initiator: send AUTH (this side's backend info and prepare), MACed with the keys."""
        self.local_prepare = prepare
        self._send(Auth(info, prepare))

    def wait_challenge(self, end: float) -> bool:
        """Initiator: wait until the CHALLENGE came or the handshake failed (`handshake_error`),
        at most until monotonic `end`; False on timeout."""
        return self._wait_handshake(lambda: self._handshake is not Handshake.NEW, end)

    def wait_welcome(self, end: float) -> bool:
        """Initiator: wait until the peer's WELCOME came or the handshake failed
        (`handshake_error`), at most until monotonic `end`; False on timeout."""
        return self._wait_handshake(lambda: self._handshake.welcomed, end)

    def _wait_handshake(self, reached: Callable[[], bool], end: float) -> bool:
        with self._cond:
            while not reached() and self.handshake_error is None:
                left = end - now()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True

    def data_path_up(self) -> None:
        """This side's data path is connected: tell the peer (READY)."""
        with self._cond:
            if not self._advance(HandshakeEvent.DATA_PATH_UP):
                raise RuntimeError(f"data path up in handshake state {self._handshake.name}")
        self._send(Ready())

    def _advance(self, event: HandshakeEvent) -> bool:
        """Move the handshake on by `event` (session lock held); False, changing nothing, if
        `event` does not apply in the current state (see `handshake.Handshake`)."""
        after = self._handshake.after(event)
        if after is None:
            return False
        self._handshake = after
        self._cond.notify_all()
        return True

    def wait_peer_ready(self, end: float) -> bool:
        """Wait until the peer's READY arrived or the session closed, at most until monotonic
        `end`; returns `ready`."""
        with self._cond:
            while self._handshake not in (Handshake.PEER_READY, Handshake.READY) and not self.closed:
                left = end - now()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            return self.ready

    # ---- control messages from the peer (ControlPlane's thread)
    def on_message(self, message: Message | None) -> None:
        """Apply one authenticated message of the peer; None (a kind this version does not know)
        only proves that the peer is alive."""
        self.last_heard = now()
        handler = None if message is None else self._handlers.get(type(message))
        if handler is not None:
            handler(message)

    def _on_welcome(self, m: Welcome) -> None:
        with self._cond:
            # a second WELCOME, or one to the acceptor, changes nothing
            if self.initiator and self._advance(HandshakeEvent.WELCOME):
                self.remote_info = m.info
                self.remote_prepare = m.prepare

    def _on_ready(self, m: Ready) -> None:
        with self._cond:
            # a second READY, or one before the WELCOME (out of order: never from an honest
            # acceptor, which sends WELCOME first on the same connection), changes nothing
            self._advance(HandshakeEvent.PEER_READY)

    def _on_heartbeat(self, m: Heartbeat) -> None:
        pass  # on_message already noted that the peer is alive

    def _on_bye(self, m: Bye) -> None:
        if m.reason is FailureReason.CLOSED:
            self.terminate(FailureReason.PEER_DIED, "peer closed the session: " + m.detail,
                           notify=False)
        else:
            self.terminate(m.reason, "peer: " + m.detail, notify=False)

    def _on_abort(self, m: Abort) -> None:
        self.abort_request(m.request_id, m.stream, m.reason, "peer: " + m.detail, notify=False)
