"""`Handshake`: where a `Session` stands in bringing itself up, and the only transitions between
those states (`Handshake.after`).

Held by `sessionbase.SessionBase` and moved by `session.Session` under the session lock, on the
initiator by `Endpoint.connect` and the control plane (CHALLENGE, WELCOME), on the acceptor by the
control plane's bring-up, and on both by the peer's READY. The close state is not part of it: a
session closes from any of these states (`SessionBase.closed`).

Initiator: NEW -CHALLENGE-> CHALLENGED -WELCOME-> WELCOMED. The acceptor starts in WELCOMED: its
Session is made from the initiator's AUTH, which carries what a WELCOME carries. Then, in either
order, this side's data path comes up (DATA_PATH_UP: it sends READY) and the peer's READY arrives
(PEER_READY); after both the session is READY.
"""

from __future__ import annotations

import enum


class HandshakeEvent(enum.Enum):
    CHALLENGE = "challenge"  # initiator: the acceptor's CHALLENGE came; the keys are known
    WELCOME = "welcome"  # initiator: the acceptor's WELCOME came; its backend info is known
    DATA_PATH_UP = "data_path_up"  # this side's data path is connected (READY sent)
    PEER_READY = "peer_ready"  # the peer's READY came: its data path is connected


class Handshake(enum.Enum):
    NEW = "new"  # initiator: HELLO sent, no CHALLENGE yet
    CHALLENGED = "challenged"  # initiator: AUTH sent, no WELCOME yet
    WELCOMED = "welcomed"  # the peer's backend info is known; no READY either way yet
    LOCAL_READY = "local_ready"  # this side's READY sent, the peer's not yet come
    PEER_READY = "peer_ready"  # the peer's READY came, this side's data path not up yet
    READY = "ready"  # both data paths up

    @classmethod
    def initial(cls, initiator: bool) -> Handshake:
        return cls.NEW if initiator else cls.WELCOMED

    def after(self, event: HandshakeEvent) -> Handshake | None:
        """The state `event` leads to from this one; None if `event` does not belong here (a
        second WELCOME or READY, or one out of order: the caller ignores a peer's, and a local
        one is a bug)."""
        return _NEXT.get((self, event))

    @property
    def welcomed(self) -> bool:
        """The peer's backend info is known (WELCOMED or later)."""
        return self not in (Handshake.NEW, Handshake.CHALLENGED)


_E = HandshakeEvent
_NEXT = {
    (Handshake.NEW, _E.CHALLENGE): Handshake.CHALLENGED,
    (Handshake.CHALLENGED, _E.WELCOME): Handshake.WELCOMED,
    (Handshake.WELCOMED, _E.DATA_PATH_UP): Handshake.LOCAL_READY,
    (Handshake.WELCOMED, _E.PEER_READY): Handshake.PEER_READY,
    (Handshake.LOCAL_READY, _E.PEER_READY): Handshake.READY,
    (Handshake.PEER_READY, _E.DATA_PATH_UP): Handshake.READY,
}
