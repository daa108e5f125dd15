"""`ControlSockets`: every zmq socket of one control plane, their options, and how messages leave.

Owns the zmq context, the CURVE layer when the endpoint has a secret (keyed by it: a peer without
it completes no handshake, so libzmq buffers nothing it sends), the options every control socket
carries (MAXMSGSIZE, TOS, the ROUTER's handshake deadline and heartbeats), the ROUTER bound at the
endpoint's address, one DEALER per session this endpoint initiated with the zmq monitor watching
it until its ZMTP handshake ends, the poller over them, and the `Link` of each session: the
connection its messages must arrive on and their MAC (`transmit` seals them).

Used by the control thread only: `control.ControlPlane`, `control_initiate.Initiator` (DEALERs)
and `control_accept.Acceptor` (`send_unauthenticated`, `transmit`). What travels over the sockets
is `lynx_transport.wire`'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from .auth import NO_SECRET, Channel, control_key
from .limits import Limits
from .wire import Hello, Message, encode

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("lynx_transport")

# IP TOS of the control plane (heartbeats, announcements, completion notices, acks): "minimize
# delay", which Linux maps to socket priority 6, the ANCHOR's band in a priority qdisc. Unmarked,
# control messages sat in a lower band than the ANCHOR (EF, priority 6): on a 10 Mbit/s link an
# ANCHOR of 8 s starved the sender's heartbeats, and the receiver declared the live peer dead.
CONTROL_TOS = 0x10
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
class Link:
    """How one session's messages travel and are authenticated. The route is fixed when the
    session is created: a message naming the session on any other connection is dropped."""

    session: Session
    route: bytes | None = None  # acceptor: the peer's ROUTER routing id
    dealer: zmq.Socket | None = None  # initiator: the session's own DEALER
    monitor: zmq.Socket | None = None  # initiator: the DEALER's events until its handshake ends
    nonce: bytes = b""  # initiator: its HELLO nonce, needed when the CHALLENGE comes
    channel: Channel | None = None  # None until both nonces are known


def peer_address(frame: zmq.Frame) -> str:
    """The IP address a ROUTER frame came from ("" where the transport has none)."""
    try:
        return frame.get("Peer-Address") or ""
    except zmq.ZMQError:  # a transport without addresses (inproc, ipc)
        return ""


class ControlSockets:
    """The ROUTER (bound on construction), the initiators' DEALERs and monitors, and their poller."""

    def __init__(self, host: str, port: int, *, secret: bytes, limits: Limits, heartbeat_s: float,
                 peer_timeout_s: float, count: Callable[[str], None]) -> None:
        self._limits = limits
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._count = count
        self._curve: tuple[bytes, bytes] | None = None  # the CURVE server's (public, secret) key
        if secret != NO_SECRET:
            if not zmq.has("curve"):
                raise RuntimeError("an Endpoint with a secret needs a libzmq with CURVE support "
                                   "for its control connections (pyzmq's wheels have it)")
            key = z85.encode(control_key(secret))
            self._curve = (zmq.curve_public(key), key)
        self._ctx = zmq.Context()
        self.router = self._socket(zmq.ROUTER)
        if port:
            self.router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self.router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.dealers: dict[zmq.Socket, Link] = {}
        self.monitors: dict[zmq.Socket, Link] = {}

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

    def open_dealer(self, session: Session, address: str, hello: Hello) -> Link:
        """Initiator: a DEALER to `address` for `session`, watched until its ZMTP handshake ends,
        with `hello` queued on it."""
        d = self._socket(zmq.DEALER)
        link = Link(session, dealer=d, nonce=hello.nonce)
        link.monitor = d.get_monitor_socket(HANDSHAKE_EVENTS,
                                            addr=f"inproc://lynx-ctrl-{session.id.hex()}")
        self.monitors[link.monitor] = link
        self.poller.register(link.monitor, zmq.POLLIN)
        d.connect(address)
        self.dealers[d] = link
        self.poller.register(d, zmq.POLLIN)
        with contextlib.suppress(zmq.ZMQError):
            d.send_multipart(encode(hello.KIND, session.id, hello.header()), zmq.NOBLOCK)
        return link

    def close_dealer(self, link: Link) -> None:
        """The session of an initiator's `link` closed: drop its DEALER (and monitor)."""
        self.unmonitor(link)
        self.dealers.pop(link.dealer, None)
        with contextlib.suppress(Exception):
            self.poller.unregister(link.dealer)
        link.dealer.close(100)

    def unmonitor(self, link: Link) -> None:
        """Stop watching the ZMTP handshake of `link`'s DEALER (it ended, or the session did)."""
        m = link.monitor
        if m is None:
            return
        link.monitor = None
        del self.monitors[m]
        with contextlib.suppress(KeyError):
            self.poller.unregister(m)
        with contextlib.suppress(zmq.ZMQError):
            link.dealer.disable_monitor()
        m.close(0)

    def transmit(self, link: Link, message: Message) -> None:
        """Send `message` on `link`, MACed; never blocks (zmq drops what it cannot queue)."""
        if link.channel is None:  # the session's keys are not known yet: nothing may be sent
            self._count("control_unsent_no_key")
            return
        frames = encode(message.KIND, link.session.id, message.header(), message.payload)
        frames.append(link.channel.seal(frames))
        try:
            if link.dealer is not None:
                link.dealer.send_multipart(frames, zmq.NOBLOCK)
            else:
                self.router.send_multipart([link.route, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("control send %s failed: %s", message.KIND, exc)

    def send_unauthenticated(self, route: bytes, sid: bytes, message: Message) -> None:
        """Acceptor: send a handshake message (no MAC) to the ROUTER peer `route`."""
        frames = encode(message.KIND, sid, message.header(), message.payload)
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([route, *frames], zmq.NOBLOCK)

    def close(self) -> None:
        """Close every socket and the context (after the control thread ended)."""
        with contextlib.suppress(Exception):
            self.router.close(0)
            for d in self.dealers:
                d.close(0)
            for m in self.monitors:
                m.close(0)
            self._ctx.term()
