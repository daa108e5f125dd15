"""Backend-neutral value types of `lynx_transport`: streams, extents, stream states, errors.

Everything here is plain data (no threads, no sockets) so that the SGLang integration, the `tcp`
backend and the `verbs` backend can all import it cheaply.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Largest `aux` payload that may travel with a stream's completion notice (`Session.finish`).
MAX_AUX_BYTES = 64 * 1024
# Request ids are unsigned 64-bit integers (SGLang's bootstrap_room fits); scoped per session.
MAX_REQUEST_ID = (1 << 64) - 1
# Extents one announcement may give a stream: caps what a peer's ANNOUNCE makes us store and scan.
MAX_EXTENTS = 1024


class Stream(enum.IntEnum):
    """The two KV streams. ANCHOR is high priority, RESIDUAL low priority."""

    ANCHOR = 0
    RESIDUAL = 1


STREAMS: tuple[Stream, ...] = (Stream.ANCHOR, Stream.RESIDUAL)


class Status(enum.Enum):
    """State of one (request, stream) on one side of a session."""

    PENDING = "pending"  # announced / posted, not finished yet
    COMPLETE = "complete"  # receiver: every byte landed, verified, FIN seen; sender: receiver acked
    FAILED = "failed"  # terminal; see StreamState.reason


class FailureReason(enum.Enum):
    """Why a (request, stream) failed. Stable names: the SGLang layer maps them to its errors."""

    PEER_DIED = "peer_died"  # data connection closed/reset or heartbeats stopped
    TIMEOUT = "timeout"  # the request's deadline passed before the stream completed
    CORRUPTION = "corruption"  # a chunk's checksum did not match, or byte counts disagree
    OUT_OF_BOUNDS = "out_of_bounds"  # a write fell outside the announced bounds: refused
    UNKNOWN_REQUEST = "unknown_request"  # a write named a request the receiver never announced
    RELEASED = "released"  # the receiver released the request before it completed
    ABORTED = "aborted"  # the other side (or the local user) aborted the request
    CLOSED = "closed"  # the local endpoint or session was closed
    LOCAL_ERROR = "local_error"  # anything else (exception in a backend thread, …)


@dataclass(frozen=True)
class Extent:
    """A byte range inside one registered region: `region_id`'s bytes [offset, offset + length)."""

    region_id: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"negative offset/length in {self!r}")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class StreamState:
    """Snapshot of one (request, stream) on one side. Returned by `Session.recv_state`/`send_state`.

    Times are `time.monotonic()` seconds (comparable between processes of one host).
    """

    request_id: int
    stream: Stream
    status: Status
    nbytes: int = 0  # receiver: bytes landed and verified; sender: bytes handed to the backend
    expected: int | None = None  # receiver: announced bound total; sender: total given to finish()
    t_start: float | None = None  # receiver: announce time; sender: first write posted
    t_first_byte: float | None = None  # receiver: first byte landed; sender: first byte sent
    t_done: float | None = None  # when the state became terminal
    reason: FailureReason | None = None
    detail: str = ""
    aux: bytes | None = None  # receiver: the aux bytes that came with the FIN (None before)

    @property
    def done(self) -> bool:
        return self.status is not Status.PENDING

    @property
    def ok(self) -> bool:
        return self.status is Status.COMPLETE


@dataclass(frozen=True)
class Announcement:
    """What a receiver announced for one request: per stream, the extents the sender may write.

    Extents refer to the *receiver's* regions. `stream_nbytes(s)` is the most a sender may write
    into stream `s`; `locate(s, off, n)` maps a logical stream offset onto (region, offset) pieces.
    `targets[s][i]` is what the receiver's backend published for extent `bounds[s][i]` (verbs: the
    address and rkey of a memory registration covering exactly that extent; tcp: nothing).
    """

    request_id: int
    bounds: dict[Stream, tuple[Extent, ...]]
    deadline: float | None = None  # receiver's monotonic deadline (informative on the sender)
    meta: bytes = b""  # small opaque bytes from the receiver (e.g. SGLang's metadata slot id)
    targets: dict[Stream, tuple[dict, ...]] = field(default_factory=dict)
    # The receiver will say when it waits on the RESIDUAL (WAITING, `Session.mark_waiting`).
    signals_waiting: bool = False

    def stream_nbytes(self, stream: Stream) -> int:
        return sum(e.length for e in self.bounds.get(Stream(stream), ()))

    @property
    def footprint(self) -> int:
        """An estimate of the memory this record holds on the sender, in bytes, for the
        per-session budget (`Limits.max_peer_announcement_bytes`): calibrated with tracemalloc on
        parsed ANNOUNCEs (~230 B an extent without targets, ~410 B with verbs targets, ~1 KiB
        the record itself) and rounded up."""
        extents = sum(len(v) for v in self.bounds.values())
        target_keys = sum(len(t) for v in self.targets.values() for t in v)
        return 1024 + len(self.meta) + 256 * extents + 96 * target_keys

    def locate(self, stream: Stream, offset: int, length: int) -> list[tuple[Extent, int]]:
        """Split logical bytes [offset, offset+length) of `stream` into pieces.

        Returns a list of (destination extent, offset of the piece within the logical range).
        Raises OutOfBoundsError if the range does not fit inside the announced extents.
        """
        if offset < 0 or length < 0 or offset + length > self.stream_nbytes(stream):
            raise OutOfBoundsError(
                f"request {self.request_id} {Stream(stream).name}: logical range "
                f"[{offset}, {offset + length}) exceeds announced {self.stream_nbytes(stream)} B"
            )
        pieces: list[tuple[Extent, int]] = []
        pos = 0  # logical position of the current extent's start
        done = 0
        for ext in self.bounds.get(Stream(stream), ()):
            if done >= length:
                break
            lo = max(offset + done, pos)
            hi = min(offset + length, pos + ext.length)
            if lo < hi:
                pieces.append(
                    (Extent(ext.region_id, ext.offset + (lo - pos), hi - lo), lo - offset)
                )
                done += hi - lo
            pos += ext.length
        return pieces

    def find(self, stream: Stream, region_id: int, offset: int, length: int
             ) -> tuple[Extent, dict] | None:
        """The announced extent of `stream` that holds region `region_id`'s [offset, offset+length)
        whole, with its target info; None if no single extent does."""
        stream = Stream(stream)
        infos = self.targets.get(stream, ())
        for i, e in enumerate(self.bounds.get(stream, ())):
            if e.region_id == region_id and e.offset <= offset and offset + length <= e.end:
                return e, (infos[i] if i < len(infos) else {})
        return None

    def contains(self, stream: Stream, region_id: int, offset: int, length: int) -> bool:
        """True if region `region_id`'s [offset, offset+length) lies inside one announced extent."""
        return self.find(stream, region_id, offset, length) is not None


# ----------------------------------------------------------------------------------- errors
class TransportError(Exception):
    """Base class of every error `lynx_transport` raises."""


class BackendUnavailableError(TransportError):
    """The requested backend cannot run here (e.g. pyverbs missing for `verbs`)."""


class HandshakeError(TransportError):
    """The control-plane handshake failed (secrets differ, protocol or backend mismatch, busy, peer
    unreachable)."""


class SessionClosedError(TransportError):
    """The session (or endpoint) is closed or its peer died."""


class OutOfBoundsError(TransportError):
    """A write does not fit the bounds announced for its request and stream (refused locally)."""


class UnknownRequestError(TransportError):
    """The request id is not announced (receiver) / not known (sender) on this session."""


class AnnouncementTimeoutError(UnknownRequestError):
    """The receiver did not announce the request within the sender's wait."""


class RegionError(TransportError):
    """Bad region registration or use (unknown id, read-only target, still referenced, …)."""


class StreamStateError(TransportError):
    """Operation not allowed in the stream's current state (e.g. write after finish)."""
