"""Session authentication: the shared secret, per-session keys, message MACs and replay protection.

Owns the cryptography of the protocol described in the package docstring ("Security"): deriving a
session's keys from the endpoints' shared secret and the two handshake nonces (`SessionKeys`), the
MAC and sequence number on every authenticated control message (`Channel`), the proof a tcp data
connection opens with (`data_proof`), a session's binding for the layers above
(`channel_binding`), the key of the control connections' zmq CURVE layer
(`control_key`) and the rule that an endpoint reachable from other hosts needs a secret
(`check_exposure`). Pure functions and small value types: the control plane
(`lynx_transport.control`) decides when each check runs, `lynx_transport.wire` owns the message
formats. Called by the Endpoint (`check_secret`, `check_exposure`), the control plane
(`SessionKeys`, `Channel`, `control_key`) and the tcp backend (`data_proof`) and `Session.channel_binding`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import struct
from dataclasses import dataclass

NONCE_BYTES = 32
SESSION_ID_BYTES = 16
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
_SEQ = struct.Struct("<Q")
_LEN = struct.Struct("<I")
AUTH_BYTES = _SEQ.size + MAC_BYTES  # the fourth frame of an authenticated message: seq + MAC
# Without a secret the keys are derived from this empty one: the messages are still bound to their
# session and connection and protected against replay, but anyone can compute the keys.
NO_SECRET = b""


def _hmac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


@dataclass(frozen=True)
class SessionKeys:
    """The keys of one session: one per direction for control-message MACs (a message cannot be
    reflected back to its sender as the peer's) and one that proves the data connections."""

    initiator: bytes  # MACs what the initiator sends
    acceptor: bytes  # MACs what the acceptor sends
    data: bytes

    @classmethod
    def derive(cls, secret: bytes, sid: bytes, nonce_initiator: bytes, nonce_acceptor: bytes
               ) -> SessionKeys:
        """HMAC-SHA256 key derivation. The inputs after the secret have fixed lengths, so their
        concatenation is unambiguous; both nonces are fresh, so no two sessions share keys."""
        if (len(sid), len(nonce_initiator), len(nonce_acceptor)) != (
                SESSION_ID_BYTES, NONCE_BYTES, NONCE_BYTES):
            raise ValueError("session id or nonce of the wrong length")
        master = _hmac(secret, b"lynx-transport/2 session\0", sid, nonce_initiator, nonce_acceptor)
        return cls(_hmac(master, b"initiator"), _hmac(master, b"acceptor"), _hmac(master, b"data"))


def _mac(key: bytes, seq: bytes, frames: tuple[bytes, ...] | list[bytes]) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    h.update(seq)
    for f in frames:  # length-prefixed: moving bytes from one frame to the next changes the MAC
        h.update(_LEN.pack(len(f)))
        h.update(f)
    return h.digest()


class Channel:
    """Message authentication of one session link, both directions: `seal` what we send, `check`
    what arrives. Sequence numbers start at 1 and must grow: a replayed or reordered message is
    refused (a gap is allowed: zmq may drop a message it cannot queue). Used by the control thread
    only."""

    __slots__ = ("_rx_key", "_tx_key", "rx_seq", "tx_seq")

    def __init__(self, keys: SessionKeys, initiator: bool):
        self._tx_key = keys.initiator if initiator else keys.acceptor
        self._rx_key = keys.acceptor if initiator else keys.initiator
        self.tx_seq = 0
        self.rx_seq = 0

    def seal(self, frames: list[bytes]) -> bytes:
        """The auth frame for the next message we send (its kind, header and payload frames)."""
        self.tx_seq += 1
        seq = _SEQ.pack(self.tx_seq)
        return seq + _mac(self._tx_key, seq, frames)

    def check(self, frames: tuple[bytes, ...], auth: bytes | None) -> str | None:
        """None if `auth` is the peer's valid MAC of `frames` with a sequence number above every one
        accepted so far (and then that number becomes the floor); else why not."""
        if auth is None or len(auth) != AUTH_BYTES:
            return "bad_mac"
        seq = auth[:_SEQ.size]
        if not hmac.compare_digest(auth[_SEQ.size:], _mac(self._rx_key, seq, frames)):
            return "bad_mac"
        n = _SEQ.unpack(seq)[0]
        if n <= self.rx_seq:
            return "replayed"
        self.rx_seq = n
        return None


def data_proof(key: bytes, sid: bytes, stream: int) -> bytes:
    """What a tcp data connection of session `sid` for `stream` opens with: proves the dialer holds
    the session's data key (only the two ends of the handshake do)."""
    return _hmac(key, b"lynx-transport/2 tcp data\0", sid, bytes([stream]))


def channel_binding(data_key: bytes) -> bytes:
    """A value only the two ends of one session know (with a secret; without one, still unique
    to the session: both handshake nonces are in its keys), for a layer above to bind what it
    signs to this session: a signed claim replayed on another session does not verify there."""
    return _hmac(data_key, b"lynx-transport/2 channel binding\0")


def control_key(secret: bytes) -> bytes:
    """The Curve25519 secret key of every control plane's zmq CURVE server in a deployment (32
    bytes), derived from the shared secret. CurveZMQ never sends the server's public key: a client
    must know it to open its HELLO box, so only holders of the secret complete a control
    connection's handshake, and nobody else gets a single zmq frame buffered."""
    return _hmac(secret, b"lynx-transport/2 zmq curve server\0")


def check_secret(secret: bytes | None) -> bytes | None:
    """`secret` as bytes, or a TypeError / ValueError saying what a usable one is."""
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes (e.g. secrets.token_bytes(32)), not "
                        f"{type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret is {len(secret)} B; use at least {MIN_SECRET_BYTES} random bytes "
                         "(e.g. secrets.token_bytes(32)): a guessable secret can be found offline "
                         "from one recorded handshake")
    return bytes(secret)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name or interface: assume other hosts can reach it
        return False


def check_exposure(host: str, secret: bytes | None, allow_insecure: bool) -> None:
    """Refuse to listen where other hosts can reach us without a secret, unless the caller opted
    out (`allow_insecure`): anyone who can connect could otherwise open sessions and write into
    the memory this endpoint announces."""
    if secret is None and not allow_insecure and not is_loopback(host):
        raise ValueError(
            f"lynx_transport Endpoint on {host!r} without a secret: any host that can reach it "
            "could open a session and write into announced memory. Give every endpoint of the "
            "deployment the same secret, Endpoint(..., secret=<at least 16 random bytes, e.g. "
            "secrets.token_bytes(32), shared out of band>), or pass allow_insecure=True on an "
            "isolated, trusted network (only loopback is allowed without either)")
