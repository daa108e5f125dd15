"""`Initiator`: the initiator's half of the control-plane handshake, up to the session's keys.

Owns what this endpoint does for a session it opens (`Endpoint.connect`) until the acceptor's
WELCOME: its DEALER and HELLO, the end of that DEALER's ZMTP handshake (a failed one is what
another secret, or CURVE against none, looks like), and the acceptor's CHALLENGE (the session's
keys: `auth.SessionKeys`) or REJECT. The WELCOME and later messages are authenticated and go to
the Session like any other.

Called by the control thread only (`control.ControlPlane`); it opens sockets through
`control_sockets.ControlSockets` and reports to the Session (`challenged`, `refused`). What it is
given on a DEALER comes from a peer that has proven nothing yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import parse_monitor_message

from .auth import Channel, SessionKeys
from .control_sockets import ControlSockets, Link
from .wire import Challenge, Envelope, Hello, Reject, VersionMismatch, WireError, parse

if TYPE_CHECKING:
    from .session import Session


class Initiator:
    """HELLO, then CHALLENGE or REJECT, on the DEALER of each session this endpoint opens."""

    def __init__(self, sockets: ControlSockets, *, secret: bytes, endpoint_id: str,
                 backend_name: str, count: Callable[[str], None]) -> None:
        self._sockets = sockets
        self._secret = secret
        self._endpoint_id = endpoint_id
        self._backend_name = backend_name
        self._count = count

    def open(self, session: Session, address: str, nonce: bytes) -> Link:
        """Open `session`'s DEALER to the acceptor at `address` and send its HELLO."""
        hello = Hello(self._backend_name, self._endpoint_id, self._sockets.address, nonce)
        return self._sockets.open_dealer(session, address, hello)

    def on_reply(self, link: Link, env: Envelope) -> None:
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

    def on_monitor(self, link: Link) -> None:
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
            self._sockets.unmonitor(link)
