"""`SessionBase`: what the two roles of a `Session` share, and the two links a Session has.

A Session is one class (`session.Session`) assembled from its receiver role
(`receiver.ReceiverRole`) and its sender role (`sender.SenderRole`); both derive from
`SessionBase`, which owns the state common to the roles: identity, the session lock and condition,
handshake state, the closed state, and the links to the Endpoint (`SessionHost`) and to the
control plane (`SessionControl`). Nothing outside the Session classes uses it directly.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Protocol

from .auth import channel_binding
from .backend import Backend
from .handshake import Handshake
from .limits import Limits
from .memory import Region
from .types import FailureReason, SessionClosedError, Stream, StreamState
from .wire import Message


def now() -> float:
    return time.monotonic()


class SessionHost(Protocol):
    """What a Session uses of its Endpoint (`endpoint.Endpoint` implements it)."""

    backend: Backend
    backend_counts_incoming: bool
    checksum: bool
    default_deadline_s: float | None
    limits: Limits
    unsafe_skip_bounds: bool

    def region(self, rid: int) -> Region: ...  # raises RegionError if not registered

    def find_region(self, rid: int) -> Region | None: ...

    def region_refs(self, rids: Iterable[int], delta: int) -> None: ...

    def count(self, key: str, n: int = 1) -> None: ...

    def progress(self) -> None: ...  # a receive stream moved (`Endpoint.on_progress`)


class SessionControl(Protocol):
    """What a Session uses of the control plane (`control.ControlPlane` implements it)."""

    @property
    def stopped(self) -> bool: ...

    def send(self, sid: bytes, message: Message, *, force: bool = False) -> None: ...

    def forget(self, sid: bytes) -> None: ...

    def spawn(self, target: Callable[[], None], name: str) -> None: ...


class SessionBase(ABC):
    """State and helpers shared by `ReceiverRole` and `SenderRole` (see the module docstring)."""

    def __init__(self, host: SessionHost, control: SessionControl, sid: bytes, initiator: bool,
                 peer_address: str):
        self._host = host
        self._control = control
        self.id = sid
        self.initiator = initiator
        self.peer_address = peer_address
        self.peer_endpoint_id = ""
        self.remote_info: dict = {}
        self.remote_prepare: dict = {}
        self.local_prepare: dict = {}
        self.data_key = b""  # proves this session's data connections (from the handshake)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._handshake = Handshake.initial(initiator)  # moved by `Session` under _lock
        self.closed = False
        self.close_reason: FailureReason | None = None
        self.close_detail = ""
        self.last_heard = now()
        self.handshake_error: str | None = None

    @property
    def channel_binding(self) -> bytes:
        """32 bytes unique to this session and known to its two ends only (`auth.channel_binding`):
        what a layer above signs to bind a claim to this session. Known once the handshake has
        derived the keys (before `connect` / `accept` return it)."""
        if not self.data_key:
            raise SessionClosedError(f"session {self.id.hex()[:8]} has no keys yet")
        return channel_binding(self.data_key)

    @property
    def ready(self) -> bool:
        return self._handshake is Handshake.READY and not self.closed

    def check_open(self) -> None:
        """Raise SessionClosedError (with the close reason) if the session is closed."""
        if self.closed:
            raise SessionClosedError(
                f"session {self.id.hex()[:8]} closed: "
                f"{self.close_reason.value if self.close_reason else ''} {self.close_detail}"
            )

    @abstractmethod
    def terminate(self, reason: FailureReason, detail: str, notify: bool) -> None:
        """Close the session for `reason` (`session.Session`: it involves both roles)."""

    def _send(self, message: Message, force: bool = False) -> None:
        self._control.send(self.id, message, force=force)

    def _drain(self, request_id: int, timeout: float, stream: Stream | None = None) -> bool:
        return self._host.backend.drain(self.id, request_id, timeout, stream=stream)

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _wait_done(self, state: Callable[[], StreamState], timeout: float | None) -> StreamState:
        """Poll `state()` under the session condition until it is terminal or `timeout` passes;
        returns the last snapshot either way (check `.done`)."""
        end = None if timeout is None else now() + timeout
        with self._cond:
            while True:
                st = state()
                if st.done:
                    return st
                left = None if end is None else end - now()
                if left is not None and left <= 0:
                    return st
                self._cond.wait(0.05 if left is None else min(left, 0.05))
