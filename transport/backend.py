"""The contract between the backend-neutral `Endpoint` and a data-path backend (tcp, verbs).

The `Endpoint` (with its `ControlPlane` and `Session`s) owns everything that is not moving
bytes: the control plane (pyzmq: handshake, announcements, acks, heartbeats), the request/stream
state machines, bounds bookkeeping, deadlines.
A `Backend` moves bytes: it registers regions, brings up a per-session data path, sends posted
`WriteOp`s in priority order followed by each stream's `FinOp`, and (receiver side) lands incoming
bytes only through `BackendHooks.open_incoming`, which enforces the announced bounds.

Backends are selected by name and imported lazily (`load_backend`): "tcp" → `lynx_transport.tcp`,
"verbs" → `lynx_transport.verbs` (pyverbs; imported only when asked for).

Threading: backend threads call `BackendHooks` methods; hooks are thread-safe and never block for
long (they take short per-session/per-stream locks). Backend methods are called from user threads
and from the endpoint's control thread; they must be thread-safe and, except `session_connect`,
`drain`, `session_close` and `close`, non-blocking.

Exposure contract: the receiver calls `expose` for every extent it announces and `withdraw` when it
releases the request; whatever `expose` returns is sent to the peer with the announcement, so it
must grant no more than that extent (verbs: a memory registration of exactly that range; the
region-wide registration is never published).

Ordering contract (all backends): within one session and one stream, a `FinOp` is delivered to the
receiver after every byte of the `WriteOp`s posted before it on that stream has landed (tcp: same
socket; verbs: same RC QP, WRITE then WRITE_WITH_IMM/SEND).

Priority contract: the backend keeps one queue per stream per session. `PriorityPolicy.mode ==
"strict"`: no RESIDUAL byte is handed to the wire while ANCHOR work is queued on that session (at
the backend's chunk granularity; a RESIDUAL chunk already handed over is not recalled). "weighted":
when both are backlogged RESIDUAL gets `residual_share` of the bytes, so it never starves.
`PriorityPolicy.link_order` (strict mode, tcp backend): across the requests of a session, a
request whose RESIDUAL is late may go before newer requests' ANCHOR work (`link_order`); the
verbs backend keeps plain strict order. A receiver that announced a request with
`signals_waiting` says when it waits on the RESIDUAL (WAITING): the session hands that to
`Backend.waiting`, and the tcp backend's link order takes it in place of its own guess.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from .memory import Region
from .types import BackendUnavailableError, Extent, FailureReason, Stream, TransportError

# Largest chunk a sender cuts (`PriorityPolicy.chunk_bytes`); a receiver refuses a larger frame.
MAX_CHUNK_BYTES = 1 << 30

BACKENDS: dict[str, str] = {
    "tcp": "lynx_transport.tcp:TcpBackend",
    "verbs": "lynx_transport.verbs:VerbsBackend",  # owned by the verbs (pyverbs RDMA) work
}


@dataclass(frozen=True)
class PriorityPolicy:
    """How a session shares its link between the streams.

    mode: "strict" (default) or "weighted". residual_share: weighted mode's share of bytes for
    RESIDUAL while both streams are backlogged (0 < share < 1). chunk_bytes: scheduling/checksum
    unit; a large write is split into chunks of at most this size. link_order: strict mode's
    order across requests by `link_order.LinkOrder` (a request whose Residual is later than its
    byte bound by more than the newer requests' queued Anchors take on the link goes before them)
    instead of every ANCHOR byte before every RESIDUAL byte; tcp backend only.
    """

    mode: str = "strict"
    residual_share: float = 0.1
    chunk_bytes: int = 1 << 20
    link_order: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("strict", "weighted"):
            raise ValueError(f"priority mode must be 'strict' or 'weighted', not {self.mode!r}")
        if not 0.0 < self.residual_share < 1.0:
            raise ValueError("residual_share must be in (0, 1)")
        if not 4096 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [4096, {MAX_CHUNK_BYTES}]")
        if self.link_order and self.mode != "strict":
            raise ValueError("link_order orders strict mode's streams across requests; "
                             f"mode {self.mode!r} has no such order")


@dataclass
class WriteOp:
    """One posted write: local (src, src_offset, length) → peer's (dst_region_id, dst_offset).

    The Endpoint has already checked it against the peer's announcement: it lies inside the
    announced extent `dst_extent`, whose target the peer published as `dst_info` (verbs: the
    "addr" and "rkey" of that extent's registration, "addr" being `dst_extent.offset`'s address;
    tcp: {}).
    """

    session_id: bytes
    request_id: int
    stream: Stream
    src: Region
    src_offset: int
    length: int
    dst_region_id: int
    dst_offset: int
    dst_extent: Extent | None = None
    dst_info: dict = field(default_factory=dict)
    checksum: bool = True
    signalled: bool = False  # the receiver will say when it waits (Announcement.signals_waiting)


@dataclass
class FinOp:
    """Completion notice for (request, stream): `total` bytes were written; `aux` rides along."""

    session_id: bytes
    request_id: int
    stream: Stream
    total: int
    aux: bytes = b""
    signalled: bool = False  # as WriteOp's


class Refused(TransportError):
    """Raised by `BackendHooks.open_incoming` when an incoming write must not land."""

    def __init__(self, reason: FailureReason, detail: str = ""):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class IncomingWrite(Protocol):
    """Receiver-side handle for one incoming chunk, from `BackendHooks.open_incoming`.

    `view` is the destination memory (exactly `length` bytes, inside announced bounds). The backend
    lands bytes only inside `with handle.guard() as ok:` blocks, and only if `ok` is True; when ok
    is False (the request was released/failed meanwhile) it must discard the rest of the chunk.
    Each guard should cover one bounded operation (one recv_into call), never an unbounded wait.
    Then it calls `finish(nbytes, ok, reason, detail)` exactly once.
    """

    view: memoryview

    def guard(self) -> AbstractContextManager[bool]: ...

    def finish(
        self,
        nbytes: int,
        ok: bool = True,
        reason: FailureReason | None = None,
        detail: str = "",
    ) -> None: ...


class BackendHooks(Protocol):
    """Callbacks the Endpoint gives its backend. All thread-safe; none blocks for long."""

    def open_incoming(
        self,
        session_id: bytes,
        request_id: int,
        stream: Stream,
        region_id: int,
        offset: int,
        length: int,
    ) -> IncomingWrite:
        """Validate an incoming write before any byte lands; raise `Refused` if it must not."""
        ...

    def incoming_fin(
        self, session_id: bytes, request_id: int, stream: Stream, total: int, aux: bytes
    ) -> None:
        """The sender finished (request, stream) with `total` bytes; every byte before it landed."""
        ...

    def sent(self, session_id: bytes, request_id: int, stream: Stream, nbytes: int) -> None:
        """Sender side: `nbytes` more bytes of (request, stream) left this host (or completed)."""
        ...

    def send_failed(
        self,
        session_id: bytes,
        request_id: int,
        stream: Stream,
        reason: FailureReason,
        detail: str = "",
    ) -> None:
        """Sender side: an op of (request, stream) could not be sent."""
        ...

    def session_lost(self, session_id: bytes, reason: FailureReason, detail: str = "") -> None:
        """The data path of a session is gone (peer closed, reset, fatal error)."""
        ...


class Backend(ABC):
    """A data-path backend. One instance per Endpoint.

    Constructed as `cls(hooks, host, policy, options, checksum)`: `host` is the local address to
    bind/listen on (tcp) or to select the device/GID by (verbs may ignore it); `options` is a dict
    of backend-specific settings (unknown keys must raise ValueError); `checksum` is the
    Endpoint's setting: True makes every chunk this endpoint *receives* need a checksum (a chunk
    without one fails its stream CORRUPTION and lands nothing) and is published in `local_info`, so
    that a sender checksums every chunk for this receiver whatever its own setting.
    """

    name: str = "?"
    # True if the backend reports every landed chunk through open_incoming/finish (tcp). A backend
    # whose receiver CPU does not see individual writes (verbs RDMA WRITE) sets False: the FIN's
    # total is then trusted (it is still checked against the announced bounds).
    counts_incoming: bool = True
    # True if bytes land without the receiver's CPU (verbs RDMA WRITE): then Session.release() on
    # the receiver waits for the sender's RELEASED reply (its drain finished) before returning.
    one_sided_writes: bool = False

    @abstractmethod
    def __init__(
        self, hooks: BackendHooks, host: str, policy: PriorityPolicy, options: dict,
        checksum: bool,
    ) -> None: ...

    # ---- identity and memory
    @abstractmethod
    def local_info(self) -> dict:
        """JSON-able info peers need to reach this backend (tcp: host + data port)."""

    @abstractmethod
    def register_region(self, region: Region) -> dict:
        """Prepare `region` for use as a source and a landing place (verbs: ibv_reg_mr without
        remote access). Returns backend info kept as region.backend_info (never sent to peers).
        May set region.backend_handle."""

    @abstractmethod
    def deregister_region(self, region: Region) -> None:
        """Undo register_region. Called only when no op or announcement references the region."""

    # ---- sessions
    @abstractmethod
    def session_prepare(self, session_id: bytes, initiator: bool, key: bytes) -> dict:
        """Create per-session resources; return JSON-able info for the peer (verbs: QPNs). Called
        only once the peer has authenticated (acceptor) or the keys are known (initiator); `key`
        is the session's data key (tcp: its data connections must prove it)."""

    @abstractmethod
    def session_connect(
        self,
        session_id: bytes,
        remote_info: dict,
        remote_prepare: dict,
        initiator: bool,
        timeout: float,
    ) -> None:
        """Bring the session's data path up (blocking, at most `timeout` s; raise on failure)."""

    def expose(self, session_id: bytes, request_id: int, region: Region, offset: int,
               length: int) -> dict:
        """Let the session's peer write region's [offset, offset + length) for `request_id` (and
        nothing more); returns the JSON-able target info the peer needs (sent in the
        announcement). Default: nothing to publish (the receiver's CPU lands every byte)."""
        return {}

    def withdraw(self, session_id: bytes, request_id: int) -> None:
        """Undo every `expose` of `request_id` on the session (idempotent; also after the session
        closed). Default: nothing to undo."""
        return None

    def waiting(self, session_id: bytes, request_id: int) -> None:
        """The session's peer now waits on the request's RESIDUAL (its WAITING, accepted once by
        the session for a request it sends). Default: nothing (the order stays strict)."""
        return None

    @abstractmethod
    def post_write(self, op: WriteOp) -> None:
        """Queue a write (non-blocking). Failures are reported through hooks.send_failed."""

    @abstractmethod
    def post_fin(self, op: FinOp) -> None:
        """Queue a completion notice behind every write posted before it on the same stream."""

    @abstractmethod
    def drain(self, session_id: bytes, request_id: int, timeout: float,
              stream: Stream | None = None) -> bool:
        """Drop the request's queued ops (only `stream`'s if given); wait until none of their
        source bytes will be read again (timeout 0: just drop, report whether already true).
        Returns False if that could not be guaranteed within `timeout` (the caller then closes the
        session)."""

    @abstractmethod
    def session_close(self, session_id: bytes) -> None:
        """Tear down the session's data path and threads (idempotent, bounded time)."""

    @abstractmethod
    def close(self) -> None:
        """Close every session and release every backend resource (idempotent, bounded time)."""

    # ---- optional introspection
    def stats(self) -> dict:
        return {}

    def sessions(self) -> Iterator[bytes]:  # pragma: no cover - optional
        return iter(())


def load_backend(name: str) -> type[Backend]:
    """Import the backend class for `name` lazily ("tcp", "verbs")."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown transport backend {name!r}; known: {sorted(BACKENDS)}"
        ) from None
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}") from exc
    return getattr(module, cls_name)
