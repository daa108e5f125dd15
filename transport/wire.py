"""Control-plane message formats: framing, the HELLO handshake check, the ANNOUNCE encoding.

A control message is three zmq frames: the kind (ASCII), a JSON header that always carries the
session id (`"sid"`, hex) and an optional binary payload. Pure functions and value types only, so
that checks on what a peer sends (handshake, message shape) stay in one place, apart from the
sockets (`lynx_transport.control`) and the state they change (`lynx_transport.session`).
"""

from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass
from typing import Any

from .types import Announcement, Extent, FailureReason, Stream

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class ControlMessage:
    kind: str
    sid: bytes
    header: dict
    payload: bytes


def encode(kind: str, header: dict, payload: bytes = b"") -> list[bytes]:
    return [kind.encode(), json.dumps(header).encode(), payload]


def decode(frames: list[bytes]) -> ControlMessage | None:
    """Parse the frames of one message (at least kind and header); None if they are malformed."""
    try:
        kind = frames[0].decode()
        header = json.loads(frames[1])
        payload = frames[2] if len(frames) > 2 else b""
        sid = bytes.fromhex(header["sid"])
    except Exception:
        return None
    return ControlMessage(kind, sid, header, payload)


def failure_reason(value: Any, default: FailureReason) -> FailureReason:
    """A peer's failure reason; `default` for one this version does not know."""
    try:
        return FailureReason(value)
    except ValueError:
        return default


# ---------------------------------------------------------------------------------- handshake
@dataclass(frozen=True)
class LocalIdentity:
    """What an endpoint states in its HELLO and demands of a peer's HELLO."""

    endpoint_id: str
    backend_name: str
    token: bytes | None


@dataclass(frozen=True)
class Hello:
    """The initiator's HELLO. Fields hold what the peer sent, unchecked (see `check_hello`)."""

    version: Any
    token: Any  # hex of the shared secret ("" without one)
    backend: Any
    info: dict  # the initiator backend's local_info()
    prepare: dict  # its session_prepare() for this session
    endpoint: str
    address: str  # its control-plane address (informative)

    @classmethod
    def from_header(cls, h: dict) -> Hello:
        return cls(h.get("version"), h.get("token", ""), h.get("backend"), h.get("info", {}),
                   h.get("prepare", {}), h.get("endpoint", ""), h.get("address", "?"))

    def to_header(self) -> dict:
        return {"version": self.version, "token": self.token, "backend": self.backend,
                "info": self.info, "prepare": self.prepare, "endpoint": self.endpoint,
                "address": self.address}


def make_hello(local: LocalIdentity, info: dict, prepare: dict, address: str) -> Hello:
    return Hello(PROTOCOL_VERSION, (local.token or b"").hex(), local.backend_name, info, prepare,
                 local.endpoint_id, address)


def check_hello(hello: Hello, local: LocalIdentity) -> str | None:
    """Why `hello` must be rejected, or None if the session may be accepted. Raises on a token
    that is not a hex string (the control loop does not survive that yet)."""
    if hello.version != PROTOCOL_VERSION:
        return f"protocol version {hello.version} != {PROTOCOL_VERSION}"
    if local.token is not None and not hmac.compare_digest(bytes.fromhex(hello.token), local.token):
        return "bad token"
    if hello.backend != local.backend_name:
        return f"backend {hello.backend!r} != {local.backend_name!r}"
    return None


# ------------------------------------------------------------------------------------ ANNOUNCE
def announce_header(ann: Announcement, deadline_s: float | None) -> dict:
    """ANNOUNCE's header; its payload is `ann.meta`. The deadline travels relative (`deadline_s`)
    because monotonic clocks of two hosts are not comparable."""
    return {
        "req": ann.request_id,
        "bounds": {str(int(s)): [[e.region_id, e.offset, e.length] for e in exts]
                   for s, exts in ann.bounds.items()},
        "regions": {str(k): v for k, v in ann.region_info.items()},
        "deadline_in": deadline_s,
    }


def parse_announce(h: dict, payload: bytes) -> Announcement:
    req = int(h["req"])
    bounds = {Stream(int(k)): tuple(Extent(*map(int, e)) for e in v)
              for k, v in h["bounds"].items()}
    regions = {int(k): v for k, v in h.get("regions", {}).items()}
    din = h.get("deadline_in")
    deadline = None if din is None else time.monotonic() + float(din)
    return Announcement(req, bounds, deadline, payload, regions)
