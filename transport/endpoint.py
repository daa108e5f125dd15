"""User-facing objects: `Endpoint` (one per process/role) and `Session` (one per peer).

See the package docstring (`lynx_transport.__doc__`) for the API walk-through and buffer ownership.
Internals: one control thread per Endpoint owns every zmq socket (a ROUTER bound at
`Endpoint.address`, one DEALER per session this endpoint initiated), runs heartbeats and deadlines;
user threads and backend threads hand it outgoing messages through a queue + wake-up socketpair.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from .backend import Backend, FinOp, PriorityPolicy, Refused, WriteOp, load_backend
from .memory import Region, describe_buffer
from .types import (
    MAX_AUX_BYTES,
    MAX_REQUEST_ID,
    STREAMS,
    Announcement,
    Extent,
    FailureReason,
    HandshakeError,
    OutOfBoundsError,
    RegionError,
    SessionClosedError,
    Status,
    Stream,
    StreamState,
    StreamStateError,
    TransportError,
    UnknownRequestError,
)

log = logging.getLogger("lynx_transport")

PROTOCOL_VERSION = 1
# IP TOS of the control plane (heartbeats, announcements, completion notices, acks): "minimize
# delay", which Linux maps to socket priority 6, the ANCHOR's band in a priority qdisc. Unmarked,
# control messages sat in a lower band than the ANCHOR (EF, priority 6): on a 10 Mbit/s link an
# ANCHOR of 8 s starved the sender's heartbeats, and the receiver declared the live peer dead.
CONTROL_TOS = 0x10


# ------------------------------------------------------------------------------ state records
@dataclass
class _RxStream:
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while bytes land
    status: Status = Status.PENDING
    landed: int = 0
    expected: int = 0
    t_first: float | None = None
    t_done: float | None = None
    reason: FailureReason | None = None
    detail: str = ""
    aux: bytes | None = None
    fin_total: int | None = None


@dataclass
class _RxRequest:
    ann: Announcement
    t_start: float
    deadline: float | None
    streams: dict[Stream, _RxStream]
    released: bool = False


@dataclass
class _TxStream:
    status: Status = Status.PENDING
    posted: int = 0
    sent: int = 0
    total: int | None = None  # set by finish()
    t_start: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    reason: FailureReason | None = None
    detail: str = ""


@dataclass
class _TxRequest:
    streams: dict[Stream, _TxStream]
    deadline: float | None = None
    regions: set = field(default_factory=set)


def _now() -> float:
    return time.monotonic()


class _Incoming:
    """Implements backend.IncomingWrite for one chunk."""

    __slots__ = ("_ep", "_rs", "_session", "request_id", "stream", "view")

    def __init__(self, ep, session, request_id, stream, rs: _RxStream, view: memoryview):
        self._ep = ep
        self._session = session
        self.request_id = request_id
        self.stream = stream
        self._rs = rs
        self.view = view

    @contextlib.contextmanager
    def guard(self):
        with self._rs.lock:
            yield self._rs.status is Status.PENDING

    def finish(self, nbytes, ok=True, reason=None, detail=""):
        self._session._rx_chunk_done(self.request_id, self.stream, self._rs, nbytes, ok, reason,
                                     detail)


# ----------------------------------------------------------------------------------- Session
class Session:
    """A connection to one peer Endpoint. Either side may announce (receive) and write (send).

    Receiver-side methods: `announce`, `recv_state`, `wait`, `release`.
    Sender-side methods: `announcement`, `wait_announcement`, `write`, `write_stream`, `finish`,
    `send_state`, `wait_sent`, `abort`, `release`.
    All are thread-safe and non-blocking except the `wait*` methods and `release` (bounded).
    """

    def __init__(self, ep: Endpoint, sid: bytes, initiator: bool, peer_address: str):
        self._ep = ep
        self.id = sid
        self.initiator = initiator
        self.peer_address = peer_address
        self.peer_endpoint_id = ""
        self._route: bytes | None = None  # ROUTER identity (acceptor side)
        self.remote_info: dict = {}
        self.remote_prepare: dict = {}
        self.local_prepare: dict = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._rx: dict[int, _RxRequest] = {}
        self._tx: dict[int, _TxRequest] = {}
        self._peer_ann: dict[int, Announcement] = {}
        self._peer_released: set[int] = set()
        # Receiver, one-sided backends (verbs): requests the sender confirmed drained after our
        # RELEASE (its "RELEASED" reply); see release().
        self._peer_fenced: set[int] = set()
        # Receiver: recently released request ids. A chunk or FIN of one of them that was already
        # on its way is dropped quietly instead of NACKed as UNKNOWN_REQUEST (which would race the
        # RELEASE message and give the sender the wrong failure reason).
        self._rx_released: collections.deque[int] = collections.deque(maxlen=4096)
        self._local_ready = False
        self._peer_ready = False
        self.closed = False
        self.close_reason: FailureReason | None = None
        self.close_detail = ""
        self.last_heard = _now()
        self.handshake_error: str | None = None

    # ------------------------------------------------------------------ common
    @property
    def ready(self) -> bool:
        return self._local_ready and self._peer_ready and not self.closed

    def __repr__(self) -> str:
        role = "initiator" if self.initiator else "acceptor"
        return f"<Session {self.id.hex()[:8]} {role} peer={self.peer_address} ready={self.ready}>"

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(
                f"session {self.id.hex()[:8]} closed: "
                f"{self.close_reason.value if self.close_reason else ''} {self.close_detail}"
            )

    def close(self) -> None:
        """Close this session (peer sees BYE → its requests fail CLOSED)."""
        self._ep._close_session(self, FailureReason.CLOSED, "closed locally", notify=True)

    # ------------------------------------------------------------------ receiver side
    def announce(
        self,
        request_id: int,
        bounds: Mapping[Stream, Sequence[Extent | tuple[int, int, int]]],
        *,
        deadline_s: float | None = None,
        meta: bytes = b"",
    ) -> None:
        """Allow the peer to write request `request_id`'s streams into the given extents.

        `bounds[stream]` lists (region_id, offset, length) extents of *this* endpoint's writable
        regions; a stream may be omitted (nothing may be written for it and it never completes).
        `deadline_s`: seconds from now after which unfinished streams fail with TIMEOUT (both
        sides). `meta`: small opaque bytes delivered to the sender with the announcement.
        """
        self._check_open()
        _check_request_id(request_id)
        if len(meta) > MAX_AUX_BYTES:
            raise ValueError(f"meta is {len(meta)} B > {MAX_AUX_BYTES}")
        norm: dict[Stream, tuple[Extent, ...]] = {}
        for s, exts in bounds.items():
            s = Stream(s)
            norm[s] = tuple(e if isinstance(e, Extent) else Extent(*e) for e in exts)
        region_info = {}
        for exts in norm.values():
            for e in exts:
                r = self._ep._region(e.region_id)
                if not r.writable:
                    raise RegionError(f"region {r.id} is read-only; it cannot receive")
                if e.end > r.length:
                    raise RegionError(f"extent {e} exceeds region {r.id} ({r.length} B)")
                region_info[e.region_id] = r.backend_info
        now = _now()
        deadline = now + deadline_s if deadline_s is not None else None
        ann = Announcement(request_id, norm, deadline, bytes(meta), region_info)
        with self._lock:
            if request_id in self._rx:
                raise StreamStateError(f"request {request_id} already announced on this session")
            streams = {
                s: _RxStream(expected=ann.stream_nbytes(s)) for s in norm
            }
            self._rx[request_id] = _RxRequest(ann, now, deadline, streams)
            self._ep._region_refs(region_info.keys(), +1)
        self._ep._send(
            self,
            "ANNOUNCE",
            {
                "req": request_id,
                "bounds": {str(int(s)): [[e.region_id, e.offset, e.length] for e in exts]
                           for s, exts in norm.items()},
                "regions": {str(k): v for k, v in region_info.items()},
                "deadline_in": deadline_s,
            },
            bytes(meta),
        )

    def recv_state(self, request_id: int, stream: Stream) -> StreamState:
        """Receiver-side snapshot of (request, stream). Raises UnknownRequestError if never
        announced (or already released)."""
        with self._lock:
            rq = self._rx.get(request_id)
            if rq is None or Stream(stream) not in rq.streams:
                raise UnknownRequestError(f"request {request_id} stream {Stream(stream).name} "
                                          "not announced on this session")
            return self._rx_snapshot(request_id, Stream(stream), rq)

    def _rx_snapshot(self, request_id: int, stream: Stream, rq: _RxRequest) -> StreamState:
        rs = rq.streams[stream]
        return StreamState(request_id, stream, rs.status, rs.landed, rs.expected, rq.t_start,
                           rs.t_first, rs.t_done, rs.reason, rs.detail, rs.aux)

    def _wait_done(self, state: Callable[[], StreamState], timeout: float | None) -> StreamState:
        """Poll `state()` under the session condition until it is terminal or `timeout` passes;
        returns the last snapshot either way (check `.done`)."""
        end = None if timeout is None else _now() + timeout
        with self._cond:
            while True:
                st = state()
                if st.done:
                    return st
                left = None if end is None else end - _now()
                if left is not None and left <= 0:
                    return st
                self._cond.wait(0.05 if left is None else min(left, 0.05))

    def wait(self, request_id: int, stream: Stream, timeout: float | None = None) -> StreamState:
        """Block until (request, stream) is terminal on the receiver side or `timeout` passes;
        returns the snapshot either way (check `.done`)."""
        return self._wait_done(lambda: self.recv_state(request_id, stream), timeout)

    def pending_requests(self) -> list[int]:
        """Request ids announced here and not yet released."""
        with self._lock:
            return list(self._rx)

    # ------------------------------------------------------------------ sender side
    def announcement(self, request_id: int) -> Announcement | None:
        """The peer's announcement for `request_id`, or None if it has not arrived yet."""
        with self._lock:
            return self._peer_ann.get(request_id)

    def wait_announcement(self, request_id: int, timeout: float | None = None) -> Announcement:
        end = None if timeout is None else _now() + timeout
        with self._cond:
            while True:
                self._check_open()
                ann = self._peer_ann.get(request_id)
                if ann is not None:
                    return ann
                left = None if end is None else end - _now()
                if left is not None and left <= 0:
                    raise UnknownRequestError(f"no announcement for request {request_id} "
                                              f"within {timeout} s")
                self._cond.wait(0.05 if left is None else min(left, 0.05))

    def _tx_stream(self, request_id: int, stream: Stream) -> tuple[_TxRequest, _TxStream]:
        rq = self._tx.get(request_id)
        if rq is None:
            rq = self._tx[request_id] = _TxRequest({s: _TxStream() for s in STREAMS})
        return rq, rq.streams[stream]

    def write(
        self,
        request_id: int,
        stream: Stream,
        src: Region | int,
        src_offset: int,
        length: int,
        dst_region_id: int,
        dst_offset: int,
        *,
        deadline_s: float | None = None,
        checksum: bool | None = None,
    ) -> None:
        """Queue a write of local `src`[src_offset : +length] to the peer's region `dst_region_id`
        at `dst_offset`, tagged (request, stream). Checked against the peer's announcement first
        (OutOfBoundsError / UnknownRequestError, nothing is sent). Non-blocking.

        `deadline_s` (first write of a request sets it): seconds from now after which the request's
        unfinished streams fail with TIMEOUT on both sides."""
        self._check_open()
        stream = Stream(stream)
        region = src if isinstance(src, Region) else self._ep._region(src)
        if region is not self._ep._regions.get(region.id):
            raise RegionError(f"region {region.id} is not registered with this endpoint")
        if src_offset < 0 or length < 0 or src_offset + length > region.length:
            raise RegionError(f"source [{src_offset}, {src_offset + length}) outside region "
                              f"{region.id} ({region.length} B)")
        with self._lock:
            ann = self._peer_ann.get(request_id)
            if ann is None or request_id in self._peer_released:
                raise UnknownRequestError(f"request {request_id}: no (live) announcement from "
                                          "the peer")
            if not self._ep._unsafe_skip_bounds and not ann.contains(
                stream, dst_region_id, dst_offset, length
            ):
                raise OutOfBoundsError(
                    f"request {request_id} {stream.name}: [{dst_offset}, {dst_offset + length}) "
                    f"of peer region {dst_region_id} is outside the announced bounds"
                )
            rq, ts = self._tx_stream(request_id, stream)
            if ts.status is not Status.PENDING:
                raise StreamStateError(f"request {request_id} {stream.name} is {ts.status.value}")
            if ts.total is not None:
                raise StreamStateError(f"request {request_id} {stream.name} already finished")
            now = _now()
            if deadline_s is not None and rq.deadline is None:
                rq.deadline = now + deadline_s
            elif rq.deadline is None and self._ep.default_deadline_s is not None:
                rq.deadline = now + self._ep.default_deadline_s
            if ts.t_start is None:
                ts.t_start = now
            ts.posted += length
            if region.id not in rq.regions:
                rq.regions.add(region.id)
                self._ep._region_refs([region.id], +1)
            op = WriteOp(self.id, request_id, stream, region, src_offset, length, dst_region_id,
                         dst_offset, ann.region_info.get(dst_region_id, {}),
                         self._ep.checksum if checksum is None else checksum)
            if length:
                self._ep.backend.post_write(op)

    def write_stream(
        self,
        request_id: int,
        stream: Stream,
        src: Region | int,
        src_offset: int,
        length: int,
        stream_offset: int = 0,
        **kw: Any,
    ) -> None:
        """Write local bytes into the peer's announced extents for `stream`, treating them as one
        logical byte range (extents concatenated in announced order) starting at `stream_offset`.
        """
        ann = self.announcement(request_id)
        if ann is None:
            raise UnknownRequestError(f"request {request_id}: no announcement from the peer")
        for ext, rel in ann.locate(stream, stream_offset, length):
            self.write(request_id, stream, src, src_offset + rel, ext.length, ext.region_id,
                       ext.offset, **kw)

    def finish(self, request_id: int, stream: Stream, aux: bytes = b"") -> None:
        """Mark (request, stream) complete on the sender: after every byte written so far lands,
        the receiver sees the stream COMPLETE together with `aux` (≤ MAX_AUX_BYTES; e.g. SGLang's
        first output token, sent with the ANCHOR). A stream with no writes may be finished too."""
        self._check_open()
        stream = Stream(stream)
        aux = bytes(aux)
        if len(aux) > MAX_AUX_BYTES:
            raise ValueError(f"aux is {len(aux)} B > {MAX_AUX_BYTES}")
        with self._lock:
            ann = self._peer_ann.get(request_id)
            if ann is None or request_id in self._peer_released:
                raise UnknownRequestError(f"request {request_id}: no (live) announcement")
            rq, ts = self._tx_stream(request_id, stream)
            if ts.status is not Status.PENDING or ts.total is not None:
                raise StreamStateError(f"request {request_id} {stream.name} already finished "
                                       f"({ts.status.value})")
            ts.total = ts.posted
            if ts.t_start is None:
                ts.t_start = _now()
            if rq.deadline is None and self._ep.default_deadline_s is not None:
                rq.deadline = _now() + self._ep.default_deadline_s
            self._ep.backend.post_fin(FinOp(self.id, request_id, stream, ts.total, aux))

    def send_state(self, request_id: int, stream: Stream) -> StreamState:
        """Sender-side snapshot: COMPLETE once the receiver acknowledged every byte."""
        with self._lock:
            rq = self._tx.get(request_id)
            if rq is None:
                raise UnknownRequestError(f"request {request_id}: nothing sent on this session")
            ts = rq.streams[Stream(stream)]
            return StreamState(request_id, Stream(stream), ts.status, ts.sent, ts.total,
                               ts.t_start, ts.t_first, ts.t_done, ts.reason, ts.detail, None)

    def wait_sent(self, request_id: int, stream: Stream, timeout: float | None = None
                  ) -> StreamState:
        return self._wait_done(lambda: self.send_state(request_id, stream), timeout)

    def abort(self, request_id: int, reason: str = "aborted by user") -> None:
        """Fail every pending stream of `request_id` on both sides (either role)."""
        self._ep._abort_request(self, request_id, None, FailureReason.ABORTED, reason, notify=True)

    # ------------------------------------------------------------------ both roles
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
        ep = self._ep
        with self._lock:
            rq = self._rx.pop(request_id, None)
            tq = self._tx.pop(request_id, None)
            self._peer_ann.pop(request_id, None)
            if rq is not None:
                self._rx_released.append(request_id)
        notify_peer = False
        # One-sided backends (verbs RDMA WRITE) place bytes without the receiver's help: a stream
        # that is not COMPLETE may still have chunks in flight, so release must wait until the
        # sender has drained the request (its RELEASED reply) before the staging is reusable.
        fence = (rq is not None and not self.closed
                 and getattr(ep.backend, "one_sided_writes", False)
                 and any(rs.status is not Status.COMPLETE for rs in rq.streams.values()))
        if rq is not None:
            for rs in rq.streams.values():
                # taking the lock waits for a chunk landing right now (one bounded socket read)
                with rs.lock:
                    if rs.status is Status.PENDING:
                        self._set_rx_failed_locked(rs, FailureReason.RELEASED, "released")
                        notify_peer = True
            rq.released = True
            ep._region_refs(rq.ann.region_info.keys(), -1)
            if (notify_peer or fence) and not self.closed:
                ep._send(self, "RELEASE", {"req": request_id, "fence": fence})
            if fence:
                end = _now() + timeout
                with self._cond:
                    while request_id not in self._peer_fenced and not self.closed:
                        left = end - _now()
                        if left <= 0:
                            break
                        self._cond.wait(min(left, 0.05))
                    fenced = request_id in self._peer_fenced
                    self._peer_fenced.discard(request_id)
                if not fenced:  # closing destroys the data path: nothing lands after that
                    ep._close_session(self, FailureReason.TIMEOUT,
                                      f"sender did not drain request {request_id}", notify=True)
        if tq is not None:
            if not self.closed:
                ok = ep._drain(self.id, request_id, timeout)
                if not ok:
                    ep._close_session(self, FailureReason.TIMEOUT,
                                      f"could not drain request {request_id}", notify=True)
            ep._region_refs(tq.regions, -1)
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ internals (rx)
    def _set_rx_failed_locked(self, rs: _RxStream, reason: FailureReason, detail: str) -> None:
        rs.status = Status.FAILED
        rs.reason = reason
        rs.detail = detail
        rs.t_done = _now()

    def _rx_fail(self, request_id: int, stream: Stream | None, reason: FailureReason,
                 detail: str, notify_kind: str | None) -> None:
        with self._lock:
            rq = self._rx.get(request_id)
            targets = [] if rq is None else (
                list(rq.streams.items()) if stream is None
                else [(stream, rq.streams[stream])] if stream in rq.streams else []
            )
        changed = []
        for s, rs in targets:
            with rs.lock:
                if rs.status is Status.PENDING:
                    self._set_rx_failed_locked(rs, reason, detail)
                    changed.append(s)
        if notify_kind and not self.closed:
            for s in changed or ([stream] if stream is not None and rq is None else []):
                self._ep._send(self, notify_kind, {"req": request_id, "stream": int(s),
                                                   "reason": reason.value, "detail": detail})
        if changed:
            self._ep._count("rx_failed_" + reason.value, len(changed))
            with self._cond:
                self._cond.notify_all()

    def _rx_chunk_done(self, request_id, stream, rs: _RxStream, nbytes, ok, reason, detail):
        if not ok:
            self._rx_fail(request_id, stream, reason or FailureReason.LOCAL_ERROR, detail, "NACK")
            return
        complete = False
        with rs.lock:
            if rs.status is not Status.PENDING:
                return
            if rs.t_first is None and nbytes:
                rs.t_first = _now()
            rs.landed += nbytes
            if rs.fin_total is not None and rs.landed == rs.fin_total:
                rs.status = Status.COMPLETE
                rs.t_done = _now()
                complete = True
        if complete:
            self._rx_completed(request_id, stream, rs)

    def _rx_completed(self, request_id, stream, rs: _RxStream) -> None:
        self._ep._send(self, "ACK", {"req": request_id, "stream": int(stream),
                                     "nbytes": rs.landed})
        with self._cond:
            self._cond.notify_all()

    def _rx_fin(self, request_id, stream, total, aux) -> None:
        with self._lock:
            rq = self._rx.get(request_id)
            rs = None if rq is None else rq.streams.get(stream)
        if rs is None:
            if rq is None and request_id in self._rx_released:
                return  # FIN of a request released here: it was already on its way
            self._ep._count("fin_unknown_request")
            if not self.closed:
                self._ep._send(self, "NACK", {"req": request_id, "stream": int(stream),
                                              "reason": FailureReason.UNKNOWN_REQUEST.value,
                                              "detail": "FIN for a request not announced"})
            return
        counts = self._ep.backend_counts_incoming
        fail = None
        complete = False
        with rs.lock:
            if rs.status is not Status.PENDING:
                return
            rs.aux = aux
            rs.fin_total = total
            if aux is None:
                fail = "completion notice failed its checksum"
            elif total > rs.expected:
                fail = f"FIN says {total} B > announced {rs.expected} B"
            elif not counts:
                rs.landed = total
                if rs.t_first is None:
                    rs.t_first = _now()
                complete = True
            elif rs.landed == total:
                complete = True
            elif rs.landed > total:
                fail = f"landed {rs.landed} B > FIN total {total} B"
            else:
                # the backend delivers FIN after all data of the stream: missing bytes are lost
                fail = f"FIN total {total} B but only {rs.landed} B landed"
            if complete:
                rs.status = Status.COMPLETE
                rs.t_done = _now()
        if fail:
            self._rx_fail(request_id, stream, FailureReason.CORRUPTION, fail, "NACK")
        elif complete:
            self._rx_completed(request_id, stream, rs)

    # ------------------------------------------------------------------ internals (tx)
    def _tx_fail(self, request_id, stream: Stream | None, reason, detail) -> list[Stream]:
        changed = []
        with self._lock:
            rq = self._tx.get(request_id)
            if rq is None:
                return changed
            for s, ts in rq.streams.items():
                if stream is not None and s != stream:
                    continue
                if ts.status is Status.PENDING and (ts.posted or ts.total is not None
                                                    or stream is not None):
                    ts.status = Status.FAILED
                    ts.reason = reason
                    ts.detail = detail
                    ts.t_done = _now()
                    changed.append(s)
            self._cond.notify_all()
        if changed:
            self._ep._count("tx_failed_" + reason.value, len(changed))
        return changed


def _check_request_id(request_id: int) -> None:
    if not isinstance(request_id, int) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id must be an int in [0, 2**64): {request_id!r}")


# ---------------------------------------------------------------------------------- Endpoint
class Endpoint:
    """One transport endpoint: registered regions + control plane + a data backend.

    Endpoint(backend="tcp", host="127.0.0.1", port=0, token=None, policy=PriorityPolicy(),
             checksum=True, heartbeat_s=0.5, peer_timeout_s=5.0, default_deadline_s=None,
             backend_options=None)

    `address` is the control-plane address peers pass to `connect`. Use as a context manager or
    call `close()`; close joins every thread it started.
    """

    def __init__(
        self,
        backend: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | bytes | None = None,
        policy: PriorityPolicy | None = None,
        checksum: bool = True,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 5.0,
        default_deadline_s: float | None = None,
        backend_options: dict | None = None,
        name: str = "",
        _unsafe_skip_bounds: bool = False,
    ) -> None:
        self.host = host
        self.name = name or f"ep-{os.getpid()}"
        self.id = os.urandom(8).hex()
        self.token = token.encode() if isinstance(token, str) else token
        self.policy = policy or PriorityPolicy()
        self.checksum = checksum
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.default_deadline_s = default_deadline_s
        self._unsafe_skip_bounds = _unsafe_skip_bounds  # tests only: lets bad writes reach peers
        self._regions: dict[int, Region] = {}
        self._region_users: dict[int, int] = {}
        self._region_ids = itertools.count(1)
        self._sessions: dict[bytes, Session] = {}
        self._accepted: queue.Queue[Session] = queue.Queue()
        self._lock = threading.RLock()
        self._counters: dict[str, int] = {}
        self._closed = False
        self._threads: list[threading.Thread] = []

        backend_cls = load_backend(backend)
        self.backend_name = backend
        self.backend: Backend = backend_cls(self._hooks(), host, self.policy,
                                            dict(backend_options or {}))
        self.backend_counts_incoming = getattr(self.backend, "counts_incoming", True)

        # control plane
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.TOS, CONTROL_TOS)
        if port:
            self._router.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._router.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._dealers: dict[bytes, zmq.Socket] = {}
        self._outq: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ctrl = threading.Thread(target=self._control_loop, name=f"lynx-ctrl-{self.name}",
                                      daemon=True)
        self._ctrl.start()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.name} {self.backend_name} {self.address}>"

    # ------------------------------------------------------------------ regions
    def register(self, buf: Any, length: int | None = None, *, name: str = "") -> Region:
        """Register local memory: a buffer object (numpy array, bytearray, memoryview, mmap; must
        be C-contiguous) or an integer address with `length`. Returns the Region (use `.id` in
        announcements, the object itself as a write source). The caller keeps owning the memory:
        it must stay valid until `deregister` returns (buffer objects are kept alive meanwhile).
        """
        addr, n, writable, owner = describe_buffer(buf, length)
        with self._lock:
            rid = next(self._region_ids)
            region = Region(rid, addr, n, writable, name, owner)
            region.backend_info = dict(self.backend.register_region(region) or {})
            self._regions[rid] = region
            self._region_users[rid] = 0
        return region

    def deregister(self, region: Region | int) -> None:
        """Undo `register`. Raises RegionError while an announcement or an unreleased sent request
        still references the region (release those requests first)."""
        rid = region.id if isinstance(region, Region) else int(region)
        with self._lock:
            r = self._regions.get(rid)
            if r is None:
                raise RegionError(f"region {rid} is not registered")
            if self._region_users.get(rid, 0) > 0:
                raise RegionError(f"region {rid} is still referenced by "
                                  f"{self._region_users[rid]} unreleased request(s)")
            del self._regions[rid]
            del self._region_users[rid]
        self.backend.deregister_region(r)

    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    def _region(self, rid: int) -> Region:
        try:
            return self._regions[rid]
        except KeyError:
            raise RegionError(f"region {rid} is not registered") from None

    def _region_refs(self, rids, delta: int) -> None:
        with self._lock:
            for rid in rids:
                rid = int(rid)
                if rid in self._region_users:
                    self._region_users[rid] = max(0, self._region_users[rid] + delta)

    # ------------------------------------------------------------------ sessions
    def connect(self, address: str, timeout: float = 10.0) -> Session:
        """Open a session to the Endpoint at `address` (its `.address`). Blocks until the data
        path is up on both sides or raises HandshakeError after `timeout` s."""
        self._check_open()
        sid = os.urandom(16)
        s = Session(self, sid, True, address)
        with self._lock:
            self._sessions[sid] = s
        try:
            s.local_prepare = self.backend.session_prepare(sid, True)
            self._outq.put(("CONNECT", sid, address))
            self._send(s, "HELLO", {
                "version": PROTOCOL_VERSION,
                "token": (self.token or b"").hex(),
                "backend": self.backend_name,
                "info": self.backend.local_info(),
                "prepare": s.local_prepare,
                "endpoint": self.id,
                "address": self.address,
            })
            end = _now() + timeout
            with s._cond:
                while not s.remote_prepare and s.handshake_error is None:
                    left = end - _now()
                    if left <= 0:
                        raise HandshakeError(f"no answer from {address} within {timeout} s")
                    s._cond.wait(min(left, 0.05))
            if s.handshake_error:
                raise HandshakeError(f"{address} refused the session: {s.handshake_error}")
            self.backend.session_connect(sid, s.remote_info, s.remote_prepare, True,
                                         max(0.1, end - _now()))
            s._local_ready = True
            self._send(s, "READY", {})
            with s._cond:
                while not s._peer_ready and not s.closed:
                    left = end - _now()
                    if left <= 0:
                        raise HandshakeError(f"{address} did not become ready within {timeout} s")
                    s._cond.wait(min(left, 0.05))
            s._check_open()
            return s
        except Exception as exc:
            self._close_session(s, FailureReason.CLOSED, f"connect failed: {exc}", notify=True)
            if isinstance(exc, TransportError):
                raise
            raise HandshakeError(f"connect to {address} failed: {exc}") from exc

    def accept(self, timeout: float | None = None) -> Session | None:
        """Next session a peer opened to this endpoint (ready to use), or None after `timeout`."""
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def sessions(self) -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.closed]

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counters)
        out["backend"] = self.backend.stats()
        return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + n

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("endpoint closed")

    # ------------------------------------------------------------------ close
    def close(self, timeout: float = 5.0) -> None:
        """Close every session (peers are told), stop the control thread and the backend."""
        if self._closed:
            return
        for s in list(self._sessions.values()):
            self._close_session(s, FailureReason.CLOSED, "endpoint closed", notify=True)
        self._closed = True
        self._outq.put(("STOP",))
        self._wake()
        self._ctrl.join(timeout)
        for t in self._threads:
            t.join(timeout)
        try:
            self.backend.close()
        finally:
            with contextlib.suppress(Exception):
                self._router.close(0)
                for d in self._dealers.values():
                    d.close(0)
                self._ctx.term()
            self._wake_r.close()
            self._wake_w.close()

    def _close_session(self, s: Session, reason: FailureReason, detail: str, notify: bool) -> None:
        with s._lock:
            if s.closed:
                return
            s.closed = True
            s.close_reason = reason
            s.close_detail = detail
        if notify and not self._closed:
            self._send(s, "BYE", {"reason": reason.value, "detail": detail}, force=True)
        with s._lock:
            rx_ids = list(s._rx)
            tx_ids = list(s._tx)
        for rid in rx_ids:
            s._rx_fail(rid, None, reason, detail, None)
        for rid in tx_ids:
            s._tx_fail(rid, None, reason, detail)
        with contextlib.suppress(Exception):
            self.backend.session_close(s.id)
        if not self._closed:
            self._outq.put(("DROP", s.id))
            self._wake()
        with s._cond:
            s._cond.notify_all()
        log.debug("session %s closed: %s %s", s.id.hex()[:8], reason.value, detail)

    def _drain(self, sid: bytes, request_id: int, timeout: float,
               stream: Stream | None = None) -> bool:
        return self.backend.drain(sid, request_id, timeout, stream=stream)

    def _abort_request(self, s: Session, request_id: int, stream: Stream | None,
                       reason: FailureReason, detail: str, notify: bool) -> None:
        s._rx_fail(request_id, stream, reason, detail, None)
        changed = s._tx_fail(request_id, stream, reason, detail)
        if changed:
            with contextlib.suppress(Exception):
                self._drain(s.id, request_id, 0.0, stream)
        if notify and not s.closed:
            self._send(s, "ABORT", {"req": request_id,
                                    "stream": None if stream is None else int(stream),
                                    "reason": reason.value, "detail": detail})

    # ------------------------------------------------------------------ backend hooks
    def _hooks(self):
        ep = self

        class Hooks:
            def open_incoming(self, sid, request_id, stream, region_id, offset, length):
                return ep._open_incoming(sid, request_id, stream, region_id, offset, length)

            def incoming_fin(self, sid, request_id, stream, total, aux):
                s = ep._sessions.get(sid)
                if s is not None:
                    s._rx_fin(request_id, Stream(stream), total, aux)

            def sent(self, sid, request_id, stream, nbytes):
                s = ep._sessions.get(sid)
                if s is None:
                    return
                with s._lock:
                    rq = s._tx.get(request_id)
                    if rq is None:
                        return
                    ts = rq.streams[Stream(stream)]
                    if ts.t_first is None and nbytes:
                        ts.t_first = _now()
                    ts.sent += nbytes

            def send_failed(self, sid, request_id, stream, reason, detail=""):
                s = ep._sessions.get(sid)
                if s is not None:
                    ep._abort_request(s, request_id, Stream(stream), reason, detail, notify=True)

            def session_lost(self, sid, reason, detail=""):
                s = ep._sessions.get(sid)
                if s is not None:
                    ep._close_session(s, reason, detail, notify=True)

        return Hooks()

    def _open_incoming(self, sid, request_id, stream, region_id, offset, length) -> _Incoming:
        s = self._sessions.get(sid)
        if s is None or s.closed:
            raise Refused(FailureReason.CLOSED, "session closed")
        stream = Stream(stream)
        with s._lock:
            rq = s._rx.get(request_id)
            rs = None if rq is None else rq.streams.get(stream)
        if rq is None:
            self._count("refused_unknown_request")
            if request_id in s._rx_released:  # no NACK: the RELEASE message tells the sender
                raise Refused(FailureReason.RELEASED, f"request {request_id} was released")
            detail = f"write for request {request_id} that is not announced"
            self._send(s, "NACK", {"req": request_id, "stream": int(stream),
                                   "reason": FailureReason.UNKNOWN_REQUEST.value,
                                   "detail": detail})
            raise Refused(FailureReason.UNKNOWN_REQUEST, detail)
        if rs is None or not rq.ann.contains(stream, region_id, offset, length) \
                or region_id not in self._regions:
            self._count("refused_out_of_bounds")
            detail = (f"request {request_id} {stream.name}: write to region {region_id} "
                      f"[{offset}, {offset + length}) outside the announced bounds")
            s._rx_fail(request_id, stream, FailureReason.OUT_OF_BOUNDS, detail, "NACK")
            raise Refused(FailureReason.OUT_OF_BOUNDS, detail)
        if rs.status is not Status.PENDING:
            raise Refused(rs.reason or FailureReason.LOCAL_ERROR,
                          f"request {request_id} {stream.name} is {rs.status.value}")
        view = self._regions[region_id].slice(offset, length)
        return _Incoming(self, s, request_id, stream, rs, view)

    # ------------------------------------------------------------------ control plane
    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _send(self, s: Session, kind: str, header: dict, payload: bytes = b"",
              force: bool = False) -> None:
        if self._closed and not force:
            return
        header = dict(header)
        header["sid"] = s.id.hex()
        self._outq.put(("MSG", s.id, kind, header, payload))
        self._wake()

    def _control_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_hb = _now()
        try:
            while True:
                try:
                    events = dict(poller.poll(20))
                except zmq.ZMQError:
                    break
                if self._wake_r.fileno() in events or events.get(self._wake_r):
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                stop = self._drain_outq(poller)
                if stop:
                    break
                if self._router in events:
                    while True:
                        try:
                            frames = self._router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frames(frames[0], frames[1:])
                for d in list(self._dealers.values()):
                    if d in events:
                        while True:
                            try:
                                frames = d.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            self._on_frames(None, frames)
                now = _now()
                if now - last_hb >= self.heartbeat_s:
                    last_hb = now
                    self._housekeeping(now)
                else:
                    self._check_deadlines(now)
        except Exception:  # pragma: no cover - logged, endpoint unusable
            log.exception("control loop crashed")
        finally:
            self._drain_outq(poller, final=True)

    def _drain_outq(self, poller: zmq.Poller, final: bool = False) -> bool:
        stop = False
        while True:
            try:
                item = self._outq.get_nowait()
            except queue.Empty:
                return stop
            kind = item[0]
            if kind == "STOP":
                stop = True
            elif kind == "CONNECT" and not final:
                _, sid, address = item
                d = self._ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.TOS, CONTROL_TOS)
                d.connect(address)
                self._dealers[sid] = d
                poller.register(d, zmq.POLLIN)
            elif kind == "DROP":
                d = self._dealers.pop(item[1], None)
                if d is not None:
                    with contextlib.suppress(Exception):
                        poller.unregister(d)
                    d.close(100)
                with self._lock:
                    self._sessions.pop(item[1], None)
            elif kind == "MSG":
                _, sid, mkind, header, payload = item
                frames = [mkind.encode(), json.dumps(header).encode(), payload]
                try:
                    d = self._dealers.get(sid)
                    if d is not None:
                        d.send_multipart(frames, zmq.NOBLOCK)
                    else:
                        s = self._sessions.get(sid)
                        if s is not None and s._route is not None:
                            self._router.send_multipart([s._route, *frames], zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    log.debug("control send %s failed: %s", mkind, exc)

    def _on_frames(self, route: bytes | None, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        try:
            kind = frames[0].decode()
            header = json.loads(frames[1])
            payload = frames[2] if len(frames) > 2 else b""
            sid = bytes.fromhex(header["sid"])
        except Exception:
            self._count("control_garbage")
            return
        if kind == "HELLO":
            self._on_hello(route, sid, header)
            return
        s = self._sessions.get(sid)
        if s is None:
            return
        s.last_heard = _now()
        try:
            self._dispatch(s, kind, header, payload)
        except Exception:
            log.exception("control message %s failed", kind)

    def _on_hello(self, route: bytes | None, sid: bytes, h: dict) -> None:
        if route is None or sid in self._sessions:
            return
        s = Session(self, sid, False, h.get("address", "?"))
        s._route = route
        s.peer_endpoint_id = h.get("endpoint", "")

        def reject(reason: str) -> None:
            self._count("handshake_rejected")
            frames = [b"REJECT", json.dumps({"sid": sid.hex(), "reason": reason}).encode(), b""]
            with contextlib.suppress(zmq.ZMQError):
                self._router.send_multipart([route, *frames], zmq.NOBLOCK)

        if h.get("version") != PROTOCOL_VERSION:
            return reject(f"protocol version {h.get('version')} != {PROTOCOL_VERSION}")
        if self.token is not None and not hmac.compare_digest(
            bytes.fromhex(h.get("token", "")), self.token
        ):
            return reject("bad token")
        if h.get("backend") != self.backend_name:
            return reject(f"backend {h.get('backend')!r} != {self.backend_name!r}")
        s.remote_info = h.get("info", {})
        s.remote_prepare = h.get("prepare", {})
        try:
            s.local_prepare = self.backend.session_prepare(sid, False)
        except Exception as exc:
            return reject(f"backend prepare failed: {exc}")
        with self._lock:
            self._sessions[sid] = s
        self._send(s, "WELCOME", {"info": self.backend.local_info(),
                                  "prepare": s.local_prepare, "endpoint": self.id})

        def bring_up() -> None:
            try:
                self.backend.session_connect(sid, s.remote_info, s.remote_prepare, False, 10.0)
                s._local_ready = True
                self._send(s, "READY", {})
                end = _now() + 10.0
                with s._cond:
                    while not s._peer_ready and not s.closed and _now() < end:
                        s._cond.wait(0.05)
                if s.ready:
                    self._accepted.put(s)
                elif not s.closed:
                    self._close_session(s, FailureReason.CLOSED, "peer never ready", True)
            except Exception as exc:
                self._close_session(s, FailureReason.CLOSED, f"data path failed: {exc}", True)

        t = threading.Thread(target=bring_up, name=f"lynx-accept-{sid.hex()[:6]}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()

    def _dispatch(self, s: Session, kind: str, h: dict, payload: bytes) -> None:
        if kind == "WELCOME":
            with s._cond:
                s.remote_info = h.get("info", {})
                s.peer_endpoint_id = h.get("endpoint", "")
                s.remote_prepare = h.get("prepare", {}) or {"_": 1}
                s._cond.notify_all()
        elif kind == "REJECT":
            with s._cond:
                s.handshake_error = h.get("reason", "rejected")
                s._cond.notify_all()
        elif kind == "READY":
            with s._cond:
                s._peer_ready = True
                s._cond.notify_all()
        elif kind == "HB":
            pass
        elif kind == "BYE":
            reason = _reason(h.get("reason"), FailureReason.CLOSED)
            if reason is FailureReason.CLOSED:
                detail = "peer closed the session: " + h.get("detail", "")
            else:
                detail = "peer: " + h.get("detail", "")
            self._close_session(s, FailureReason.PEER_DIED if reason is FailureReason.CLOSED
                                else reason, detail, notify=False)
        elif kind == "ANNOUNCE":
            req = int(h["req"])
            bounds = {Stream(int(k)): tuple(Extent(*map(int, e)) for e in v)
                      for k, v in h["bounds"].items()}
            regions = {int(k): v for k, v in h.get("regions", {}).items()}
            din = h.get("deadline_in")
            ann = Announcement(req, bounds, None if din is None else _now() + float(din),
                               payload, regions)
            with s._cond:
                s._peer_ann[req] = ann
                s._peer_released.discard(req)
                s._cond.notify_all()
        elif kind == "RELEASE":
            req = int(h["req"])
            with s._cond:
                s._peer_released.add(req)
                s._cond.notify_all()
            if s._tx_fail(req, None, FailureReason.RELEASED, "receiver released the request"):
                self._drain(s.id, req, 0.0)
            if h.get("fence"):
                self._start_fence_reply(s, req)
        elif kind == "RELEASED":
            with s._cond:
                s._peer_fenced.add(int(h["req"]))
                s._cond.notify_all()
        elif kind == "ACK":
            req, stream = int(h["req"]), Stream(int(h["stream"]))
            with s._cond:
                rq = s._tx.get(req)
                if rq is not None:
                    ts = rq.streams[stream]
                    if ts.status is Status.PENDING:
                        ts.status = Status.COMPLETE
                        ts.t_done = _now()
                s._cond.notify_all()
        elif kind == "NACK":
            req, stream = int(h["req"]), Stream(int(h["stream"]))
            reason = _reason(h.get("reason"), FailureReason.LOCAL_ERROR)
            if s._tx_fail(req, stream, reason, "receiver: " + h.get("detail", "")):
                self._drain(s.id, req, 0.0, stream)
        elif kind == "ABORT":
            req = int(h["req"])
            stream = None if h.get("stream") is None else Stream(int(h["stream"]))
            reason = _reason(h.get("reason"), FailureReason.ABORTED)
            self._abort_request(s, req, stream, reason, "peer: " + h.get("detail", ""),
                                notify=False)

    def _start_fence_reply(self, s: Session, req: int) -> None:
        """Sender side of release()'s fence: once no chunk of `req` is in flight any more, reply
        RELEASED (off the control thread: draining waits for the data path)."""

        def reply() -> None:
            if self._drain(s.id, req, 2.0):
                self._send(s, "RELEASED", {"req": req})
            else:
                self._close_session(s, FailureReason.TIMEOUT,
                                    f"could not drain request {req} for the receiver", True)

        t = threading.Thread(target=reply, name=f"lynx-fence-{req}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()

    def _housekeeping(self, now: float) -> None:
        for s in list(self._sessions.values()):
            if s.closed:
                continue
            if s.remote_prepare or not s.initiator:
                self._send(s, "HB", {})
            if s.ready and now - s.last_heard > self.peer_timeout_s:
                self._close_session(s, FailureReason.PEER_DIED,
                                    f"no control message for {now - s.last_heard:.1f} s",
                                    notify=True)
        self._check_deadlines(now)

    def _check_deadlines(self, now: float) -> None:
        for s in list(self._sessions.values()):
            if s.closed:
                continue
            expired_rx, expired_tx = [], []
            with s._lock:
                for rid, rq in s._rx.items():
                    if rq.deadline is not None and now > rq.deadline and any(
                        rs.status is Status.PENDING for rs in rq.streams.values()
                    ):
                        expired_rx.append(rid)
                for rid, tq in s._tx.items():
                    if tq.deadline is not None and now > tq.deadline and any(
                        ts.status is Status.PENDING and (ts.posted or ts.total is not None)
                        for ts in tq.streams.values()
                    ):
                        expired_tx.append(rid)
            for rid in expired_rx:
                self._abort_request(s, rid, None, FailureReason.TIMEOUT,
                                    "receiver deadline passed", notify=True)
            for rid in expired_tx:
                self._abort_request(s, rid, None, FailureReason.TIMEOUT,
                                    "sender deadline passed", notify=True)


def _reason(value: Any, default: FailureReason) -> FailureReason:
    try:
        return FailureReason(value)
    except ValueError:
        return default


def iter_states(session: Session, request_ids: Sequence[int], stream: Stream
                ) -> Iterator[StreamState]:
    """Convenience: receiver-side snapshots of many requests (skips unknown ids)."""
    for rid in request_ids:
        with contextlib.suppress(UnknownRequestError):
            yield session.recv_state(rid, stream)
