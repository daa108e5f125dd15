"""Control-plane messages: their framing, one typed message per kind, and the checks on what a peer sent.

A message is three zmq frames — the kind (ASCII), a JSON header that always carries the session
id (`"sid"`, 32 hex digits) and a binary payload (≤ MAX_AUX_BYTES) — and, for every kind but the
three that open a handshake (HELLO, CHALLENGE, REJECT), a fourth frame: the sender's sequence
number and the HMAC of the three (`lynx_transport.auth.Channel`). `decode` checks the framing of
what arrived; `parse` turns an authenticated envelope into its message (a frozen dataclass per
kind), checking the type and range of every field. Both raise `WireError` — never anything else —
on a bad message, so the control plane can count it and drop it. `encode` is their inverse.

Pure functions and value types only: the sockets and when each check runs are
`lynx_transport.control`'s, what a message does is the `Session`'s.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from .auth import AUTH_BYTES, NONCE_BYTES, SESSION_ID_BYTES
from .types import MAX_AUX_BYTES, MAX_EXTENTS, Announcement, Extent, FailureReason, Stream

PROTOCOL_VERSION = 2
# Largest header frame we parse; also the zmq frame cap (ZMQ_MAXMSGSIZE, see `Limits`): an
# ANNOUNCE of MAX_EXTENTS extents per stream with verbs targets is about 160 KiB of JSON.
MAX_HEADER_BYTES = 256 * 1024
MAX_KIND_BYTES = 16
MAX_TEXT = 512  # reasons, details, names and addresses a peer sends
MAX_INFO_ITEMS = 32  # entries of a backend's info / prepare dict
MAX_DEADLINE_S = 7 * 24 * 3600.0
# The header frame of a WAITING at most: the session id and one request id are ~70 B of JSON.
# Checked before the JSON is parsed: a message that may come once per request is never worth
# the 256 KiB any header may be.
MAX_WAITING_HEADER_BYTES = 128
UNAUTHENTICATED = frozenset({"HELLO", "CHALLENGE", "REJECT"})
_KIND_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_HEX = re.compile("[0-9a-f]*")  # what bytes.hex() writes


class WireError(ValueError):
    """A peer's message is malformed: wrong framing, a field missing, of the wrong type or out of
    range. The message is dropped; nothing else happens."""


class VersionMismatch(WireError):
    """The peer speaks another protocol version (its HELLO or CHALLENGE says which)."""


# ------------------------------------------------------------------------------------ framing
@dataclass(frozen=True)
class Envelope:
    """One decoded message, not yet authenticated. `signed` are the frames the MAC covers."""

    kind: str
    sid: bytes
    header: dict
    payload: bytes
    signed: tuple[bytes, bytes, bytes]
    auth: bytes | None


def encode(kind: str, sid: bytes, header: dict, payload: bytes = b"") -> list[bytes]:
    """The three frames of a message (the control plane appends the auth frame)."""
    h = json.dumps({"sid": sid.hex(), **header}, separators=(",", ":")).encode()
    return [kind.encode(), h, payload]


def _reject_constant(name: str) -> Any:
    raise WireError(f"{name} is not a number this protocol accepts")


def decode(frames: list[bytes]) -> Envelope:
    """Check the framing of a received message (kind, header, payload[, auth]); WireError if bad."""
    if len(frames) not in (3, 4):
        raise WireError(f"{len(frames)} frames, expected 3 or 4")
    kind_b, header_b, payload = frames[0], frames[1], frames[2]
    if not 0 < len(kind_b) <= MAX_KIND_BYTES or not set(kind_b) <= _KIND_CHARS:
        raise WireError("bad kind frame")
    if len(header_b) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(header_b)} B > {MAX_HEADER_BYTES}")
    if kind_b == Waiting.KIND.encode() and (len(header_b) > MAX_WAITING_HEADER_BYTES or payload):
        raise WireError(f"WAITING of {len(header_b)} B header, {len(payload)} B payload (at most "
                        f"{MAX_WAITING_HEADER_BYTES} B, none)")
    if len(payload) > MAX_AUX_BYTES:
        raise WireError(f"payload of {len(payload)} B > {MAX_AUX_BYTES}")
    auth = frames[3] if len(frames) == 4 else None
    if auth is not None and len(auth) != AUTH_BYTES:
        raise WireError(f"auth frame of {len(auth)} B, expected {AUTH_BYTES}")
    try:
        header = json.loads(header_b, parse_constant=_reject_constant)
    except WireError:
        raise
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    sid = _hex(header, "sid", SESSION_ID_BYTES)
    return Envelope(kind_b.decode(), sid, header, payload, (kind_b, header_b, payload), auth)


# ------------------------------------------------------------------------------ field checks
def _need(h: dict, key: str) -> Any:
    if key not in h:
        raise WireError(f"field {key!r} missing")
    return h[key]


def _uint(h: dict, key: str, bits: int = 64) -> int:
    v = _need(h, key)
    if type(v) is not int or not 0 <= v < (1 << bits):
        raise WireError(f"{key}: expected an unsigned {bits}-bit integer")
    return v


def _text(h: dict, key: str, default: str | None = None) -> str:
    v = h.get(key, default)
    if type(v) is not str or len(v) > MAX_TEXT:
        raise WireError(f"{key}: expected a string of at most {MAX_TEXT} characters")
    return v


def _hex(h: dict, key: str, nbytes: int) -> bytes:
    v = _need(h, key)
    # bytes.fromhex skips whitespace, so a length check alone would let "0a 0b" through as a
    # shorter value that re-encodes differently: only the canonical form is accepted.
    if type(v) is not str or len(v) != 2 * nbytes or _HEX.fullmatch(v) is None:
        raise WireError(f"{key}: expected {2 * nbytes} hex digits")
    return bytes.fromhex(v)


def _bool(h: dict, key: str) -> bool:
    v = h.get(key, False)
    if type(v) is not bool:
        raise WireError(f"{key}: expected true or false")
    return v


def _stream(v: Any) -> Stream:
    if type(v) is not int or v not in (0, 1):
        raise WireError(f"stream must be 0 or 1, not {v!r}")
    return Stream(v)


def _reason(h: dict, default: FailureReason) -> FailureReason:
    """A peer's failure reason; `default` for a name this version does not know."""
    name = _text(h, "reason", default.value)
    try:
        return FailureReason(name)
    except ValueError:
        return default


def _scalar_ok(v: Any) -> bool:
    if v is None or type(v) is bool:
        return True
    if type(v) is int:
        return -(1 << 63) <= v < (1 << 64)
    if type(v) is float:
        return math.isfinite(v)
    return type(v) is str and len(v) <= MAX_TEXT


def _info(v: Any, what: str) -> dict:
    """A backend's JSON info (local_info, session_prepare, an extent's target): a flat object of
    scalars and short lists of scalars. The backend checks the fields it reads."""
    if not isinstance(v, dict) or len(v) > MAX_INFO_ITEMS:
        raise WireError(f"{what}: expected an object of at most {MAX_INFO_ITEMS} entries")
    for k, x in v.items():
        if len(k) > 64:
            raise WireError(f"{what}: key too long")
        if isinstance(x, list):
            if len(x) > 16 or not all(_scalar_ok(y) for y in x):
                raise WireError(f"{what}.{k}: expected a short list of scalars")
        elif not _scalar_ok(x):
            raise WireError(f"{what}.{k}: not a scalar this protocol accepts")
    return v


# ----------------------------------------------------------------------------------- messages
@dataclass(frozen=True)
class Message:
    """Base of the typed messages. `KIND` names it on the wire; `header()` is its JSON header
    (without the session id) and `payload` its binary frame; `parse` checks a received one."""

    KIND: ClassVar[str] = ""

    @property
    def payload(self) -> bytes:
        return b""

    def header(self) -> dict:
        return {}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Message:
        return cls()


def _version(h: dict) -> int:
    v = _uint(h, "version", 32)
    if v != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {v} != {PROTOCOL_VERSION}: both ends must run a "
                              "lynx_transport that speaks the same protocol (upgrade the older)")
    return v


@dataclass(frozen=True)
class Hello(Message):
    """Initiator → acceptor, first: who it is and its nonce. Unauthenticated."""

    KIND: ClassVar[str] = "HELLO"
    backend: str
    endpoint: str
    address: str  # its control-plane address (informative)
    nonce: bytes

    def header(self) -> dict:
        return {"version": PROTOCOL_VERSION, "backend": self.backend, "endpoint": self.endpoint,
                "address": self.address, "nonce": self.nonce.hex()}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Hello:
        _version(h)
        return cls(_text(h, "backend"), _text(h, "endpoint", ""), _text(h, "address", "?"),
                   _hex(h, "nonce", NONCE_BYTES))


@dataclass(frozen=True)
class Challenge(Message):
    """Acceptor → initiator: its nonce. From here on both ends can derive the session's keys
    (if they share the secret). Unauthenticated."""

    KIND: ClassVar[str] = "CHALLENGE"
    endpoint: str
    nonce: bytes

    def header(self) -> dict:
        return {"version": PROTOCOL_VERSION, "endpoint": self.endpoint, "nonce": self.nonce.hex()}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Challenge:
        _version(h)
        return cls(_text(h, "endpoint", ""), _hex(h, "nonce", NONCE_BYTES))


@dataclass(frozen=True)
class Reject(Message):
    """Acceptor → initiator: the handshake is refused, and why. Unauthenticated (a peer that
    failed to authenticate cannot check a MAC), so it is heeded only before WELCOME."""

    KIND: ClassVar[str] = "REJECT"
    reason: str

    def header(self) -> dict:
        return {"reason": self.reason[:MAX_TEXT]}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Reject:
        return cls(_text(h, "reason", "rejected"))


@dataclass(frozen=True)
class Auth(Message):
    """Initiator → acceptor: its backend's info and per-session prepare. Its MAC is the proof that
    the initiator holds the secret."""

    KIND: ClassVar[str] = "AUTH"
    info: dict
    prepare: dict

    def header(self) -> dict:
        return {"info": self.info, "prepare": self.prepare}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Auth:
        return cls(_info(_need(h, "info"), "info"), _info(_need(h, "prepare"), "prepare"))


@dataclass(frozen=True)
class Welcome(Message):
    """Acceptor → initiator: the session is accepted; its backend's info and prepare. Its MAC is
    the proof that the acceptor holds the secret."""

    KIND: ClassVar[str] = "WELCOME"
    info: dict
    prepare: dict

    def header(self) -> dict:
        return {"info": self.info, "prepare": self.prepare}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Welcome:
        return cls(_info(_need(h, "info"), "info"), _info(_need(h, "prepare"), "prepare"))


@dataclass(frozen=True)
class Ready(Message):
    """This side's data path is up."""

    KIND: ClassVar[str] = "READY"


@dataclass(frozen=True)
class Heartbeat(Message):
    KIND: ClassVar[str] = "HB"


@dataclass(frozen=True)
class Bye(Message):
    """The sender closed the session, for `reason`."""

    KIND: ClassVar[str] = "BYE"
    reason: FailureReason
    detail: str = ""

    def header(self) -> dict:
        return {"reason": self.reason.value, "detail": self.detail[:MAX_TEXT]}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Bye:
        return cls(_reason(h, FailureReason.CLOSED), _text(h, "detail", ""))


@dataclass(frozen=True)
class Announce(Message):
    """Receiver → sender: the bounds of one request (`Session.announce`); payload: its meta.
    The deadline travels relative (`deadline_in`): monotonic clocks of two hosts differ. `waits`:
    the receiver will send WAITING when it waits on the request (a peer that predates it ignores
    the field, and one that never sends it leaves it out)."""

    KIND: ClassVar[str] = "ANNOUNCE"
    request_id: int
    bounds: dict[Stream, tuple[Extent, ...]]
    targets: dict[Stream, tuple[dict, ...]]
    deadline_in: float | None = None
    meta: bytes = b""
    waits: bool = False

    @property
    def payload(self) -> bytes:
        return self.meta

    def header(self) -> dict:
        return {"req": self.request_id, "deadline_in": self.deadline_in, "waits": self.waits,
                "bounds": {str(int(s)): [[e.region_id, e.offset, e.length, info]
                                         for e, info in zip(exts, self.targets[s], strict=True)]
                           for s, exts in self.bounds.items()}}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Announce:
        raw = _need(h, "bounds")
        if not isinstance(raw, dict) or not set(raw) <= {"0", "1"}:
            raise WireError("bounds: expected an object keyed by stream ('0', '1')")
        bounds: dict[Stream, tuple[Extent, ...]] = {}
        targets: dict[Stream, tuple[dict, ...]] = {}
        for key, items in raw.items():
            if not isinstance(items, list) or len(items) > MAX_EXTENTS:
                raise WireError(f"bounds[{key}]: expected a list of at most {MAX_EXTENTS} extents")
            exts, infos = [], []
            for item in items:
                if not isinstance(item, list) or len(item) != 4:
                    raise WireError("extent: expected [region, offset, length, target]")
                e = dict(zip(("region", "offset", "length"), item[:3], strict=True))
                region, off, n = _uint(e, "region", 32), _uint(e, "offset"), _uint(e, "length")
                if off + n >= 1 << 64:
                    raise WireError("extent ends beyond 2**64")
                exts.append(Extent(region, off, n))
                infos.append(_info(item[3], "target"))
            stream = Stream(int(key))
            bounds[stream], targets[stream] = tuple(exts), tuple(infos)
        din = h.get("deadline_in")
        if din is not None and (type(din) not in (int, float) or not 0 <= din <= MAX_DEADLINE_S):
            raise WireError(f"deadline_in: expected seconds in [0, {MAX_DEADLINE_S:.0f}]")
        return cls(_uint(h, "req"), bounds, targets, din, payload, _bool(h, "waits"))

    @classmethod
    def of(cls, ann: Announcement, deadline_s: float | None) -> Announce:
        return cls(ann.request_id, ann.bounds, ann.targets, deadline_s, ann.meta,
                   ann.signals_waiting)

    def announcement(self) -> Announcement:
        """The sender's record of it (deadline made absolute on this host's clock)."""
        deadline = None if self.deadline_in is None else time.monotonic() + self.deadline_in
        return Announcement(self.request_id, self.bounds, deadline, self.meta, self.targets,
                            self.waits)


@dataclass(frozen=True)
class Release(Message):
    """Receiver → sender: the request's bounds are withdrawn. `fence`: answer RELEASED once no
    chunk of it is in flight (one-sided backends)."""

    KIND: ClassVar[str] = "RELEASE"
    request_id: int
    fence: bool = False

    def header(self) -> dict:
        return {"req": self.request_id, "fence": self.fence}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Release:
        return cls(_uint(h, "req"), _bool(h, "fence"))


@dataclass(frozen=True)
class Released(Message):
    """Sender → receiver: the fenced RELEASE of the request is drained."""

    KIND: ClassVar[str] = "RELEASED"
    request_id: int

    def header(self) -> dict:
        return {"req": self.request_id}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Released:
        return cls(_uint(h, "req"))


@dataclass(frozen=True)
class Ack(Message):
    """Receiver → sender: (request, stream) is COMPLETE with `nbytes` verified bytes."""

    KIND: ClassVar[str] = "ACK"
    request_id: int
    stream: Stream
    nbytes: int

    def header(self) -> dict:
        return {"req": self.request_id, "stream": int(self.stream), "nbytes": self.nbytes}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Ack:
        return cls(_uint(h, "req"), _stream(_need(h, "stream")), _uint(h, "nbytes"))


@dataclass(frozen=True)
class Nack(Message):
    """Receiver → sender: (request, stream) failed on the receiver, for `reason`."""

    KIND: ClassVar[str] = "NACK"
    request_id: int
    stream: Stream
    reason: FailureReason
    detail: str = ""

    def header(self) -> dict:
        return {"req": self.request_id, "stream": int(self.stream), "reason": self.reason.value,
                "detail": self.detail[:MAX_TEXT]}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Nack:
        return cls(_uint(h, "req"), _stream(_need(h, "stream")),
                   _reason(h, FailureReason.LOCAL_ERROR), _text(h, "detail", ""))


@dataclass(frozen=True)
class Abort(Message):
    """Either side: fail the request's pending streams (all, or `stream`) on both sides."""

    KIND: ClassVar[str] = "ABORT"
    request_id: int
    stream: Stream | None
    reason: FailureReason
    detail: str = ""

    def header(self) -> dict:
        return {"req": self.request_id, "stream": None if self.stream is None else int(self.stream),
                "reason": self.reason.value, "detail": self.detail[:MAX_TEXT]}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Abort:
        s = h.get("stream")
        return cls(_uint(h, "req"), None if s is None else _stream(s),
                   _reason(h, FailureReason.ABORTED), _text(h, "detail", ""))


@dataclass(frozen=True)
class Waiting(Message):
    """Receiver → sender: the receiver now waits on the request's RESIDUAL (`Session.mark_waiting`;
    in Lynx the decode's tokens do). Once per request, only for one announced with `waits`. Its
    frame is checked by size in `decode` and to the field here: a request id and nothing else."""

    KIND: ClassVar[str] = "WAITING"
    request_id: int

    def header(self) -> dict:
        return {"req": self.request_id}

    @classmethod
    def parse(cls, h: dict, payload: bytes) -> Waiting:
        if set(h) != {"sid", "req"}:
            raise WireError("WAITING: expected the fields sid and req only")
        return cls(_uint(h, "req"))


MESSAGES: dict[str, type[Message]] = {m.KIND: m for m in (
    Hello, Challenge, Reject, Auth, Welcome, Ready, Heartbeat, Bye, Announce, Release, Released,
    Ack, Nack, Abort, Waiting)}
assert set(MESSAGES) >= UNAUTHENTICATED


def parse(env: Envelope) -> Message | None:
    """The typed message of `env` (WireError if a field is bad); None for a kind this version does
    not know (a newer peer's: ignored)."""
    cls = MESSAGES.get(env.kind)
    return None if cls is None else cls.parse(env.header, env.payload)

