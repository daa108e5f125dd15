"""The sender role of a `Session`: the peer's announcements and the writes posted against them.

`SenderRole` keeps the announcements the peer sent (ANNOUNCE / RELEASE: at most
`Limits.max_peer_announcements` live ones, the excess is answered with ABORT, and as many released
ones), checks every write against them before handing it to the backend, and tracks each
(request, stream) it sends (`TxRequest`, one `TxStream` per stream) until the receiver's ACK /
NACK. It also answers a receiver's fenced RELEASE once the request is drained (one-sided
backends), and takes the receiver's WAITING (`_on_waiting`): peer input, so only for a request
it is sending whose RESIDUAL is still pending, announced with `signals_waiting`, once; anything
else is counted (`waiting_dropped_*`) and dropped. Mixed into `session.Session`; the records are
changed only here, under the session lock.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from .backend import FinOp, WriteOp
from .memory import Region
from .sessionbase import SessionBase, now
from .types import (
    MAX_AUX_BYTES,
    STREAMS,
    Announcement,
    AnnouncementTimeoutError,
    FailureReason,
    OutOfBoundsError,
    RegionError,
    Status,
    Stream,
    StreamState,
    StreamStateError,
    UnknownRequestError,
)
from .wire import Abort, Ack, Announce, Nack, Release, Released, Waiting

log = logging.getLogger("lynx_transport")


@dataclass
class TxStream:
    status: Status = Status.PENDING
    posted: int = 0
    sent: int = 0
    total: int | None = None  # set by finish()
    t_start: float | None = None
    t_first: float | None = None
    t_done: float | None = None
    reason: FailureReason | None = None
    detail: str = ""

    @property
    def started(self) -> bool:
        """Something was posted or finished: the receiver may be waiting for this stream."""
        return self.posted > 0 or self.total is not None

    def fail(self, reason: FailureReason, detail: str) -> None:
        self.status = Status.FAILED
        self.reason = reason
        self.detail = detail
        self.t_done = now()

    def complete(self) -> None:
        """The receiver acknowledged the stream (its ACK)."""
        self.status = Status.COMPLETE
        self.t_done = now()
        # The receiver holds every byte: a COMPLETE state says so even when this host's completion
        # events for the last writes are still to be counted.
        if self.total is not None:
            self.sent = self.total


@dataclass
class TxRequest:
    streams: dict[Stream, TxStream] = field(default_factory=lambda: {s: TxStream() for s in STREAMS})
    deadline: float | None = None
    regions: set[int] = field(default_factory=set)  # local source regions it holds a reference on
    waiting: bool = False  # the receiver's WAITING was taken (at most once)

    def state(self, request_id: int, stream: Stream) -> StreamState:
        ts = self.streams[stream]
        return StreamState(request_id, stream, ts.status, ts.sent, ts.total, ts.t_start,
                           ts.t_first, ts.t_done, ts.reason, ts.detail, None)

    def fail(self, stream: Stream | None, reason: FailureReason, detail: str) -> list[Stream]:
        """Fail the pending streams (the started ones, or `stream`); returns those that changed."""
        changed = []
        for s, ts in self.streams.items():
            if stream is not None and s != stream:
                continue
            if ts.status is Status.PENDING and (ts.started or stream is not None):
                ts.fail(reason, detail)
                changed.append(s)
        return changed

    def expired(self, t: float) -> bool:
        return self.deadline is not None and t > self.deadline and any(
            ts.status is Status.PENDING and ts.started for ts in self.streams.values()
        )


class SenderRole(SessionBase):
    """The sender half of `session.Session`."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._tx: dict[int, TxRequest] = {}
        self._peer_ann: dict[int, Announcement] = {}
        # Announcements the peer released, oldest first: kept (so that a write fails at once as
        # "no live announcement") until this side releases the request or more pile up than
        # Limits.max_peer_announcements.
        self._peer_released: dict[int, None] = {}
        # Sum of the footprints of `_peer_ann` (Limits.max_peer_announcement_bytes).
        self._peer_ann_bytes = 0

    # ------------------------------------------------------------------ public API
    def announcement(self, request_id: int) -> Announcement | None:
        """The peer's announcement for `request_id`, or None if it has not arrived yet."""
        with self._lock:
            return self._peer_ann.get(request_id)

    def wait_announcement(self, request_id: int, timeout: float | None = None) -> Announcement:
        end = None if timeout is None else now() + timeout
        with self._cond:
            while True:
                self.check_open()
                ann = self._peer_ann.get(request_id)
                if ann is not None:
                    return ann
                left = None if end is None else end - now()
                if left is not None and left <= 0:
                    raise AnnouncementTimeoutError(f"no announcement for request {request_id} "
                                                   f"within {timeout} s")
                self._cond.wait(0.05 if left is None else min(left, 0.05))

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
        self.check_open()
        stream = Stream(stream)
        host = self._host
        region = src if isinstance(src, Region) else host.region(src)
        if region is not host.find_region(region.id):
            raise RegionError(f"region {region.id} is not registered with this endpoint")
        if src_offset < 0 or length < 0 or src_offset + length > region.length:
            raise RegionError(f"source [{src_offset}, {src_offset + length}) outside region "
                              f"{region.id} ({region.length} B)")
        with self._lock:
            ann = self._peer_ann.get(request_id)
            if ann is None or request_id in self._peer_released:
                raise UnknownRequestError(f"request {request_id}: no (live) announcement from "
                                          "the peer")
            target = ann.find(stream, dst_region_id, dst_offset, length)
            if target is None and host.unsafe_skip_bounds:
                # tests only: aim the bad write with a real extent's target (verbs: its rkey)
                target = next(((e, info) for e, info in zip(
                    ann.bounds.get(stream, ()), ann.targets.get(stream, ()), strict=True)
                    if e.region_id == dst_region_id), None)
            elif target is None:
                raise OutOfBoundsError(
                    f"request {request_id} {stream.name}: [{dst_offset}, {dst_offset + length}) "
                    f"of peer region {dst_region_id} is outside the announced bounds"
                )
            rq, ts = self._tx_stream(request_id, stream)
            if ts.status is not Status.PENDING:
                raise StreamStateError(f"request {request_id} {stream.name} is {ts.status.value}")
            if ts.total is not None:
                raise StreamStateError(f"request {request_id} {stream.name} already finished")
            t = now()
            if deadline_s is not None and rq.deadline is None:
                rq.deadline = t + deadline_s
            elif rq.deadline is None and host.default_deadline_s is not None:
                rq.deadline = t + host.default_deadline_s
            if ts.t_start is None:
                ts.t_start = t
            ts.posted += length
            if region.id not in rq.regions:
                rq.regions.add(region.id)
                host.region_refs([region.id], +1)
            op = WriteOp(self.id, request_id, stream, region, src_offset, length, dst_region_id,
                         dst_offset, *(target or (None, {})),
                         checksum=host.checksum if checksum is None else checksum,
                         signalled=ann.signals_waiting)
            if length:
                host.backend.post_write(op)

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
        self.check_open()
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
                ts.t_start = now()
            if rq.deadline is None and self._host.default_deadline_s is not None:
                rq.deadline = now() + self._host.default_deadline_s
            self._host.backend.post_fin(FinOp(self.id, request_id, stream, ts.total, aux,
                                              signalled=ann.signals_waiting))

    def send_state(self, request_id: int, stream: Stream) -> StreamState:
        """Sender-side snapshot: COMPLETE once the receiver acknowledged every byte."""
        with self._lock:
            rq = self._tx.get(request_id)
            if rq is None:
                raise UnknownRequestError(f"request {request_id}: nothing sent on this session")
            return rq.state(request_id, Stream(stream))

    def wait_sent(self, request_id: int, stream: Stream, timeout: float | None = None
                  ) -> StreamState:
        return self._wait_done(lambda: self.send_state(request_id, stream), timeout)

    # ------------------------------------------------------------------ backend hooks
    def on_sent(self, request_id: int, stream: Stream, nbytes: int) -> None:
        """`nbytes` more bytes of (request, stream) left this host."""
        with self._lock:
            rq = self._tx.get(request_id)
            if rq is None:
                return
            ts = rq.streams[stream]
            if ts.t_first is None and nbytes:
                ts.t_first = now()
            # The receiver's ACK can overtake this host's own completions (verbs: the peer polls
            # its queue first), and `_on_ack` has then counted every byte already.
            ts.sent = ts.sent + nbytes if ts.total is None else min(ts.sent + nbytes, ts.total)

    # ------------------------------------------------------------------ control messages
    def _on_announce(self, m: Announce) -> None:
        limits = self._host.limits
        ann = m.announcement()
        why = None
        with self._cond:
            live = len(self._peer_ann) - len(self._peer_released)
            old = self._peer_ann.get(m.request_id)
            need = ann.footprint - (old.footprint if old is not None else 0)
            while (self._peer_ann_bytes + need > limits.max_peer_announcement_bytes
                   and self._peer_released):
                self._forget_oldest_released()
            if old is None and live >= limits.max_peer_announcements:
                why = (f"the sender already holds {limits.max_peer_announcements} pending "
                       "announcements of this session (Limits.max_peer_announcements)")
            elif self._peer_ann_bytes + need > limits.max_peer_announcement_bytes:
                why = (f"the session's pending announcements would hold more than "
                       f"{limits.max_peer_announcement_bytes} B on the sender "
                       "(Limits.max_peer_announcement_bytes)")
            else:
                self._peer_ann[m.request_id] = ann
                self._peer_ann_bytes += need
                self._peer_released.pop(m.request_id, None)
                self._cond.notify_all()
        if why is not None:
            self._host.count("peer_announcements_refused")
            self._send(Abort(m.request_id, None, FailureReason.ABORTED, why))

    def _forget_oldest_released(self) -> None:
        """Drop the oldest released announcement (a write to it then fails as unknown rather than
        as released). Called with the lock held."""
        oldest = next(iter(self._peer_released))
        del self._peer_released[oldest]
        gone = self._peer_ann.pop(oldest, None)
        if gone is not None:
            self._peer_ann_bytes -= gone.footprint

    def _on_release(self, m: Release) -> None:
        req = m.request_id
        with self._cond:
            if req in self._peer_ann:  # only a known request: a peer cannot grow the map
                self._peer_released[req] = None
                while len(self._peer_released) > self._host.limits.max_peer_announcements:
                    self._forget_oldest_released()
            self._cond.notify_all()
        if self._tx_fail(req, None, FailureReason.RELEASED, "receiver released the request"):
            self._drain(req, 0.0)
        if not m.fence:
            return
        # Nothing of the request in flight (the common case, and any request we never sent):
        # answer now; otherwise wait for the data path on a thread of its own.
        if self._drain(req, 0.0):
            self._send(Released(req))
        else:
            self._control.spawn(functools.partial(self._fence_reply, req), f"lynx-fence-{req}")

    def _fence_reply(self, req: int) -> None:
        """Answer a fenced RELEASE with RELEASED once no chunk of `req` is in flight any more."""
        if self._drain(req, 2.0):
            self._send(Released(req))
        else:
            self.terminate(FailureReason.TIMEOUT,
                           f"could not drain request {req} for the receiver", True)

    def _on_ack(self, m: Ack) -> None:
        with self._cond:
            rq = self._tx.get(m.request_id)
            if rq is not None:
                ts = rq.streams[m.stream]
                if ts.status is Status.PENDING:
                    ts.complete()
            self._cond.notify_all()

    def _on_waiting(self, m: Waiting) -> None:
        """The receiver waits on the request's RESIDUAL: tell the backend (its link order), once.
        Untrusted: a request this side is not sending (never, released, or its RESIDUAL no
        longer pending), one announced without `signals_waiting`, or a repeat is dropped."""
        req = m.request_id
        with self._lock:
            rq, ann = self._tx.get(req), self._peer_ann.get(req)
            if rq is None or ann is None or req in self._peer_released:
                why = "unknown"
            elif rq.streams[Stream.RESIDUAL].status is not Status.PENDING:
                why = "finished"
            elif not ann.signals_waiting:
                why = "unannounced"
            elif rq.waiting:
                why = "duplicate"
            else:
                why = None
                rq.waiting = True
        if why is not None:
            self._host.count(f"waiting_dropped_{why}")
            log.debug("session %s: WAITING for request %s dropped (%s)", self.id.hex()[:8], req,
                      why)
            return
        self._host.count("waiting_taken")
        self._host.backend.waiting(self.id, req)

    def _on_nack(self, m: Nack) -> None:
        if self._tx_fail(m.request_id, m.stream, m.reason, "receiver: " + m.detail):
            self._drain(m.request_id, 0.0, m.stream)

    # ------------------------------------------------------------------ for session.Session
    def _take_tx(self, request_id: int) -> TxRequest | None:
        """Forget the request and the peer's announcement of it (caller holds the session lock);
        returns the send record."""
        gone = self._peer_ann.pop(request_id, None)
        if gone is not None:
            self._peer_ann_bytes -= gone.footprint
        self._peer_released.pop(request_id, None)
        return self._tx.pop(request_id, None)

    def _release_tx(self, request_id: int, tq: TxRequest, timeout: float) -> None:
        """Sender half of `release` for a record `_take_tx` returned."""
        if not self.closed and not self._drain(request_id, timeout):
            self.terminate(FailureReason.TIMEOUT, f"could not drain request {request_id}",
                           notify=True)
        self._host.region_refs(tq.regions, -1)

    def _tx_ids(self, expired_at: float | None = None) -> list[int]:
        """Request ids sent on (only those past their deadline with streams pending, if
        `expired_at` is given)."""
        with self._lock:
            return [rid for rid, tq in self._tx.items()
                    if expired_at is None or tq.expired(expired_at)]

    def _tx_fail(self, request_id: int, stream: Stream | None, reason: FailureReason,
                 detail: str) -> list[Stream]:
        """Fail the request's pending streams (the started ones, or `stream`); returns those
        that changed."""
        with self._lock:
            rq = self._tx.get(request_id)
            if rq is None:
                return []
            changed = rq.fail(stream, reason, detail)
            self._cond.notify_all()
        if changed:
            self._host.count("tx_failed_" + reason.value, len(changed))
        return changed

    def _tx_stream(self, request_id: int, stream: Stream) -> tuple[TxRequest, TxStream]:
        rq = self._tx.get(request_id)
        if rq is None:
            rq = self._tx[request_id] = TxRequest()
        return rq, rq.streams[stream]
