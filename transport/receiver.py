"""The receiver role of a `Session`: announced requests and the bytes that land for them.

`ReceiverRole` owns the announcements this side made (`RxRequest`, one `RxStream` per announced
stream) and the backend's exposure of their extents (`Backend.expose` at announce, `withdraw` at
release), decides whether an incoming chunk may land (`open_incoming`, called by the backend hooks),
counts landed bytes, applies the sender's FIN and answers with ACK / NACK, and tells the sender
when this side waits on a request's RESIDUAL (`mark_waiting`: WAITING, once per request).
`IncomingChunk` is the `backend.IncomingWrite` a backend lands one chunk through. Mixed into
`session.Session`; the records are changed only here, under the session lock, except an
`RxStream`'s landing state, which its own `lock` guards (a backend holds it while bytes land, so
release and failure wait for the chunk in progress).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from .backend import Refused
from .sessionbase import SessionBase, now
from .types import (
    MAX_AUX_BYTES,
    MAX_EXTENTS,
    MAX_REQUEST_ID,
    Announcement,
    Extent,
    FailureReason,
    RegionError,
    Status,
    Stream,
    StreamState,
    StreamStateError,
    UnknownRequestError,
)
from .wire import Ack, Announce, Nack, Release, Released, Waiting


@dataclass
class RxStream:
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while bytes land
    status: Status = Status.PENDING
    landed: int = 0
    expected: int = 0
    t_first: float | None = None
    t_last: float | None = None  # the latest landing (the stall deadline's clock)
    t_done: float | None = None
    reason: FailureReason | None = None
    detail: str = ""
    aux: bytes | None = None
    fin_total: int | None = None

    def fail_locked(self, reason: FailureReason, detail: str) -> None:
        """Make the stream FAILED; the caller holds `lock` and saw it PENDING."""
        self.status = Status.FAILED
        self.reason = reason
        self.detail = detail
        self.t_done = now()

    def land_locked(self, nbytes: int) -> bool:
        """Count `nbytes` verified bytes (caller holds `lock`, stream PENDING); True if that
        completed the stream (its FIN had already arrived)."""
        if nbytes:
            self.t_last = now()
            if self.t_first is None:
                self.t_first = self.t_last
        self.landed += nbytes
        if self.fin_total is not None and self.landed == self.fin_total:
            self.status = Status.COMPLETE
            self.t_done = now()
            return True
        return False

    def fin_locked(self, total: int, aux: bytes | None, counts_incoming: bool) -> str | None:
        """Apply the sender's FIN (caller holds `lock`, stream PENDING). Returns why the stream is
        corrupt, or None when it is now COMPLETE. `aux` None: the notice failed its checksum.
        `counts_incoming` False (the backend does not report landed chunks): the FIN's total is
        trusted (it was still checked against the announced bounds)."""
        self.aux = aux
        self.fin_total = total
        if aux is None:
            return "completion notice failed its checksum"
        if total > self.expected:
            return f"FIN says {total} B > announced {self.expected} B"
        if not counts_incoming:
            self.landed = total
            self.t_last = now()
            if self.t_first is None:
                self.t_first = self.t_last
        elif self.landed > total:
            return f"landed {self.landed} B > FIN total {total} B"
        elif self.landed < total:
            # the backend delivers FIN after all data of the stream: missing bytes are lost
            return f"FIN total {total} B but only {self.landed} B landed"
        self.status = Status.COMPLETE
        self.t_done = now()
        return None


@dataclass
class RxRequest:
    ann: Announcement
    t_start: float
    deadline: float | None
    streams: dict[Stream, RxStream]
    # Seconds a started transfer may go without a byte landing (None: no limit).
    stall_s: float | None = None
    waiting_sent: bool = False  # `mark_waiting` sent its WAITING

    def state(self, stream: Stream) -> StreamState:
        rs = self.streams[stream]
        return StreamState(self.ann.request_id, stream, rs.status, rs.landed, rs.expected,
                           self.t_start, rs.t_first, rs.t_done, rs.reason, rs.detail, rs.aux)

    def expiry(self, t: float) -> str | None:
        """Which deadline has passed at `t` with streams pending (a failure detail), or None."""
        if not any(rs.status is Status.PENDING for rs in self.streams.values()):
            return None
        if self.deadline is not None and t > self.deadline:
            return f"{self.deadline - self.t_start:g} s since the announcement"
        lasts = [rs.t_last for rs in self.streams.values() if rs.t_last is not None]
        if self.stall_s is not None and lasts and t > max(lasts) + self.stall_s:
            return f"no byte landed for {self.stall_s:g} s"
        return None


class IncomingChunk:
    """`backend.IncomingWrite` for one chunk of an announced (request, stream). `done` books the
    chunk's outcome: `done(nbytes, ok, reason, detail)`."""

    __slots__ = ("_done", "_rs", "view")

    def __init__(self, rs: RxStream, view: memoryview,
                 done: Callable[[int, bool, FailureReason | None, str], None]):
        self._rs = rs
        self._done = done
        self.view = view

    @contextlib.contextmanager
    def guard(self) -> Iterator[bool]:
        with self._rs.lock:
            yield self._rs.status is Status.PENDING

    def finish(self, nbytes: int, ok: bool = True, reason: FailureReason | None = None,
               detail: str = "") -> None:
        self._done(nbytes, ok, reason, detail)


class ReceiverRole(SessionBase):
    """The receiver half of `session.Session`."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._rx: dict[int, RxRequest] = {}
        # One-sided backends (verbs): requests whose fenced RELEASE waits for the sender's RELEASED
        # reply (False), and those it confirmed drained (True); see _release_rx().
        self._fences: dict[int, bool] = {}
        # Recently released request ids. A chunk or FIN of one of them that was already on its
        # way is dropped quietly instead of NACKed as UNKNOWN_REQUEST (which would race the
        # RELEASE message and give the sender the wrong failure reason).
        self._rx_released: collections.deque[int] = collections.deque(maxlen=4096)

    # ------------------------------------------------------------------ public API
    def announce(
        self,
        request_id: int,
        bounds: Mapping[Stream, Sequence[Extent | tuple[int, int, int]]],
        *,
        deadline_s: float | None = None,
        stall_deadline_s: float | None = None,
        meta: bytes = b"",
        signals_waiting: bool = False,
    ) -> None:
        """Allow the peer to write request `request_id`'s streams into the given extents.

        `bounds[stream]` lists (region_id, offset, length) extents of *this* endpoint's writable
        regions; a stream may be omitted (nothing may be written for it and it never completes).
        `deadline_s`: seconds from now after which unfinished streams fail with TIMEOUT (both
        sides). `stall_deadline_s`: the same, counted from the latest byte that landed, once one
        has (a peer may take long to start, e.g. behind a queue, and may take long in all, e.g.
        sending layers as its forward computes them, but must not stall); on a backend that does
        not see bytes land (verbs) a stream's FIN is its landing. `meta`: small opaque
        bytes delivered to the sender with the announcement. `signals_waiting`: this side will
        call `mark_waiting` when it waits on the RESIDUAL, so the sender's link order
        (`PriorityPolicy.link_order`) waits for that word instead of guessing when it does.
        """
        self.check_open()
        _check_request_id(request_id)
        if len(meta) > MAX_AUX_BYTES:
            raise ValueError(f"meta is {len(meta)} B > {MAX_AUX_BYTES}")
        norm: dict[Stream, tuple[Extent, ...]] = {}
        for s, exts in bounds.items():
            s = Stream(s)
            norm[s] = tuple(e if isinstance(e, Extent) else Extent(*e) for e in exts)
            if len(norm[s]) > MAX_EXTENTS:
                raise ValueError(f"{len(norm[s])} extents for {s.name} > {MAX_EXTENTS}")
        regions = {}
        for exts in norm.values():
            for e in exts:
                r = self._host.region(e.region_id)
                if not r.writable:
                    raise RegionError(f"region {r.id} is read-only; it cannot receive")
                if e.end > r.length:
                    raise RegionError(f"extent {e} exceeds region {r.id} ({r.length} B)")
                regions[r.id] = r
        with self._lock:
            if request_id in self._rx:
                raise StreamStateError(f"request {request_id} already announced on this session")
            backend = self._host.backend
            try:
                targets = {s: tuple(backend.expose(self.id, request_id, regions[e.region_id],
                                                   e.offset, e.length) for e in exts)
                           for s, exts in norm.items()}
            except BaseException:
                backend.withdraw(self.id, request_id)
                raise
            t = now()
            deadline = t + deadline_s if deadline_s is not None else None
            ann = Announcement(request_id, norm, deadline, bytes(meta), targets,
                               signals_waiting)
            streams = {s: RxStream(expected=ann.stream_nbytes(s)) for s in norm}
            self._rx[request_id] = RxRequest(ann, t, deadline, streams, stall_deadline_s)
            self._host.region_refs(regions.keys(), +1)
        self._send(Announce.of(ann, deadline_s))

    def recv_state(self, request_id: int, stream: Stream) -> StreamState:
        """Receiver-side snapshot of (request, stream). Raises UnknownRequestError if never
        announced (or already released)."""
        with self._lock:
            rq = self._rx.get(request_id)
            if rq is None or Stream(stream) not in rq.streams:
                raise UnknownRequestError(f"request {request_id} stream {Stream(stream).name} "
                                          "not announced on this session")
            return rq.state(Stream(stream))

    def wait(self, request_id: int, stream: Stream, timeout: float | None = None) -> StreamState:
        """Block until (request, stream) is terminal on the receiver side or `timeout` passes;
        returns the snapshot either way (check `.done`)."""
        return self._wait_done(lambda: self.recv_state(request_id, stream), timeout)

    def mark_waiting(self, request_id: int) -> bool:
        """This side now waits on request `request_id`'s RESIDUAL (in Lynx: the decode's tokens
        do): tell the sender (WAITING), whose link order may then send that RESIDUAL before newer
        requests' ANCHORs. Sent once per request, and only while the request is announced here
        with `signals_waiting` and its RESIDUAL is pending; returns whether it was sent.
        Non-blocking, never raises for a request's state (a closed session: False)."""
        with self._lock:
            rq = self._rx.get(request_id)
            rs = None if rq is None else rq.streams.get(Stream.RESIDUAL)
            if (self.closed or rs is None or rq.waiting_sent or not rq.ann.signals_waiting
                    or rs.status is not Status.PENDING):
                return False
            rq.waiting_sent = True
        self._send(Waiting(request_id))
        return True

    def pending_requests(self) -> list[int]:
        """Request ids announced here and not yet released."""
        with self._lock:
            return list(self._rx)

    # ------------------------------------------------------------------ backend hooks
    def open_incoming(self, request_id: int, stream: Stream, region_id: int, offset: int,
                      length: int) -> IncomingChunk:
        """Validate an incoming chunk before any byte lands; raise Refused if it must not."""
        if self.closed:
            raise Refused(FailureReason.CLOSED, "session closed")
        stream = Stream(stream)
        with self._lock:
            rq = self._rx.get(request_id)
            rs = None if rq is None else rq.streams.get(stream)
        if rq is None:
            self._host.count("refused_unknown_request")
            if request_id in self._rx_released:  # no NACK: the RELEASE message tells the sender
                raise Refused(FailureReason.RELEASED, f"request {request_id} was released")
            detail = f"write for request {request_id} that is not announced"
            self._send(Nack(request_id, stream, FailureReason.UNKNOWN_REQUEST, detail))
            raise Refused(FailureReason.UNKNOWN_REQUEST, detail)
        region = self._host.find_region(region_id)
        if rs is None or not rq.ann.contains(stream, region_id, offset, length) or region is None:
            self._host.count("refused_out_of_bounds")
            detail = (f"request {request_id} {stream.name}: write to region {region_id} "
                      f"[{offset}, {offset + length}) outside the announced bounds")
            self._rx_fail(request_id, stream, FailureReason.OUT_OF_BOUNDS, detail, notify=True)
            raise Refused(FailureReason.OUT_OF_BOUNDS, detail)
        if rs.status is not Status.PENDING:
            raise Refused(rs.reason or FailureReason.LOCAL_ERROR,
                          f"request {request_id} {stream.name} is {rs.status.value}")
        return IncomingChunk(rs, region.slice(offset, length),
                             functools.partial(self._chunk_done, request_id, stream, rs))

    def incoming_fin(self, request_id: int, stream: Stream, total: int, aux: bytes | None
                     ) -> None:
        """The sender's FIN for (request, stream): every chunk before it has been reported."""
        with self._lock:
            rq = self._rx.get(request_id)
            rs = None if rq is None else rq.streams.get(stream)
        if rs is None:
            if rq is None and request_id in self._rx_released:
                return  # FIN of a request released here: it was already on its way
            self._host.count("fin_unknown_request")
            if not self.closed:
                self._send(Nack(request_id, stream, FailureReason.UNKNOWN_REQUEST,
                                "FIN for a request not announced"))
            return
        with rs.lock:
            if rs.status is not Status.PENDING:
                return
            corrupt = rs.fin_locked(total, aux, self._host.backend_counts_incoming)
        if corrupt:
            self._rx_fail(request_id, stream, FailureReason.CORRUPTION, corrupt, notify=True)
        else:
            self._rx_completed(request_id, stream, rs)

    # ------------------------------------------------------------------ control messages
    def _on_released(self, m: Released) -> None:
        with self._cond:
            if m.request_id in self._fences:  # only a fence we wait for: a peer cannot grow the map
                self._fences[m.request_id] = True
                self._cond.notify_all()

    # ------------------------------------------------------------------ for session.Session
    def _take_rx(self, request_id: int) -> RxRequest | None:
        """Forget the announcement (caller holds the session lock); returns its record."""
        rq = self._rx.pop(request_id, None)
        if rq is not None:
            self._rx_released.append(request_id)
        return rq

    def _release_rx(self, request_id: int, rq: RxRequest, timeout: float) -> None:
        """Receiver half of `release` for a record `_take_rx` returned."""
        # One-sided backends (verbs RDMA WRITE) place bytes without the receiver's help: a stream
        # that is not COMPLETE may still have chunks in flight, so release must wait until the
        # sender has drained the request (its RELEASED reply) before the staging is reusable.
        fence = (not self.closed
                 and getattr(self._host.backend, "one_sided_writes", False)
                 and any(rs.status is not Status.COMPLETE for rs in rq.streams.values()))
        notify_peer = False
        for rs in rq.streams.values():
            # taking the lock waits for a chunk landing right now (one bounded socket read)
            with rs.lock:
                if rs.status is Status.PENDING:
                    rs.fail_locked(FailureReason.RELEASED, "released")
                # Any stream short of COMPLETE: the sender is told, also when it failed here
                # earlier (a deadline): that ABORT spared the streams the sender had not started,
                # and without the RELEASE their late writes would be taken and dropped unseen.
                notify_peer |= rs.status is not Status.COMPLETE
        self._host.region_refs({e.region_id for exts in rq.ann.bounds.values() for e in exts}, -1)
        try:
            if (notify_peer or fence) and not self.closed:
                if fence:
                    with self._lock:
                        self._fences[request_id] = False
                self._send(Release(request_id, fence))
            if fence and not self._wait_fence(request_id, timeout):
                # closing destroys the data path: nothing lands after that
                self.terminate(FailureReason.TIMEOUT,
                               f"sender did not drain request {request_id}", notify=True)
        finally:
            # revokes what the peer may write (verbs: the extents' registrations)
            self._host.backend.withdraw(self.id, request_id)

    def _wait_fence(self, request_id: int, timeout: float) -> bool:
        end = now() + timeout
        with self._cond:
            while not self._fences.get(request_id) and not self.closed:
                left = end - now()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            return bool(self._fences.pop(request_id, False))

    def _rx_ids(self) -> list[int]:
        """Announced request ids."""
        with self._lock:
            return list(self._rx)

    def _rx_expired(self, t: float) -> list[tuple[int, str]]:
        """(request id, which deadline) of each announced request past a deadline at `t` with
        streams pending."""
        with self._lock:
            return [(rid, why) for rid, rq in self._rx.items()
                    if (why := rq.expiry(t)) is not None]

    def _rx_fail(self, request_id: int, stream: Stream | None, reason: FailureReason,
                 detail: str, notify: bool) -> None:
        """Fail the request's pending streams (all, or `stream`); `notify`: tell the sender (NACK)
        per changed stream."""
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
                    rs.fail_locked(reason, detail)
                    changed.append(s)
        if notify and not self.closed:
            for s in changed or ([stream] if stream is not None and rq is None else []):
                self._send(Nack(request_id, s, reason, detail))
        if changed:
            self._host.count("rx_failed_" + reason.value, len(changed))
            self._notify()
            self._host.progress()

    # ------------------------------------------------------------------ internals
    def _chunk_done(self, request_id: int, stream: Stream, rs: RxStream, nbytes: int, ok: bool,
                    reason: FailureReason | None, detail: str) -> None:
        if not ok:
            self._rx_fail(request_id, stream, reason or FailureReason.LOCAL_ERROR, detail,
                          notify=True)
            return
        with rs.lock:
            if rs.status is not Status.PENDING:
                return
            complete = rs.land_locked(nbytes)
        if complete:
            self._rx_completed(request_id, stream, rs)
        else:
            self._host.progress()

    def _rx_completed(self, request_id: int, stream: Stream, rs: RxStream) -> None:
        self._send(Ack(request_id, stream, rs.landed))
        self._notify()
        self._host.progress()


def _check_request_id(request_id: int) -> None:
    if not isinstance(request_id, int) or not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id must be an int in [0, 2**64): {request_id!r}")
