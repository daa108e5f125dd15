"""`SendLoop`: the `tcp` backend's sender thread of one session, which owns every send on it.

It picks the next chunk by `PriorityPolicy` (strict: no RESIDUAL byte goes to the kernel while
ANCHOR work is queued or, with `anchor_hold_bytes`, while the ANCHOR socket still holds unacked
bytes; with `link_order`, across requests by the session's `link_order.LinkOrder`, which it
feeds with the chunks it cuts and the bytes the peer acknowledged; weighted: by bytes sent over
each stream's share) and writes `header + payload` with
non-blocking `sendmsg` straight from the registered source memory (no copy; with TLS an SSL write
of at most `TLS_WRITE_BYTES`). It waits in poll(2) on the stream sockets and the session's wake
pipe, which `tcp.TcpBackend` writes to when it queues work or closes the session.
Started by `tcp.TcpBackend` once a session's data connections are up; reports to `BackendHooks`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import select
import socket
import ssl
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from .backend import BackendHooks, FinOp, PriorityPolicy, WriteOp
from .link_order import Choice
from .tcp_session import TcpSession
from .tcp_wire import FLAG_CRC, FLAG_XXH3, HDR, KIND_DATA, KIND_FIN, MAGIC, xxh3_32
from .types import STREAMS, FailureReason, Stream

log = logging.getLogger("lynx_transport.tcp")

SIOCOUTQ = 0x5411  # == TIOCOUTQ: bytes in a TCP socket's send queue not yet acknowledged
_OUTQ_BUF = bytes(4)
# TLS: bytes handed to one SSL write at most; OpenSSL must be given the same bytes again after a
# WANT_WRITE, and a bounded piece lets the sender return to its priority choice between pieces
TLS_WRITE_BYTES = 256 * 1024
# poll(2) events on which the sender tries a send: room, or an error the send will report
_SEND_READY = select.POLLOUT | select.POLLERR | select.POLLHUP | select.POLLNVAL
# link_order: how often the sender reads its sockets' unacknowledged bytes (the link's rate, the
# Anchors delivered); also its idle wait while an Anchor's delivery is still to be seen, so that
# a request's wait on its Residual starts within this of the delivery
OBSERVE_S = 0.01

# test seam (backend option "_corrupt_checksum"): given (session id, stream, checksum) of a DATA
# chunk about to be sent, returns the checksum to put in its header
CorruptChecksum = Callable[[bytes, Stream, int], int]


def _outq(sock: socket.socket) -> int:
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, _OUTQ_BUF))[0]
    except OSError:
        return 0


@dataclass
class QueuedOp:
    """One queued WriteOp (consumed chunk by chunk) or FinOp."""

    op: WriteOp | FinOp
    done: int = 0  # bytes of op already turned into chunks


@dataclass
class Chunk:
    """A frame being sent on one socket: header + payload view, `pos` bytes already sent."""

    request_id: int
    bufs: list
    total: int
    payload: int
    pos: int = 0
    fin: bool = False


class SendLoop:
    """The sender thread of one session (`run`); see the module docstring."""

    def __init__(self, ts: TcpSession, hooks: BackendHooks, policy: PriorityPolicy, opts: dict,
                 tls: bool):
        self.ts = ts
        self.hooks = hooks
        self.policy = policy
        self.tls = tls
        self.io_timeout = opts["io_timeout_s"]
        self.throttle = float(opts["_throttle_bps"] or 0)
        self.res_cap = int(opts["residual_notsent_lowat"] or 0)
        self.hold = int(opts["anchor_hold_bytes"])
        self.corrupt: CorruptChecksum | None = opts["_corrupt_checksum"]

    def _next_chunk(self, stream: Stream, request_id: int | None = None) -> Chunk | None:
        """Turn the head of `stream`'s queue (`request_id`'s first op on it, if given and queued)
        into a frame (called with ts.lock held)."""
        ts = self.ts
        q = ts.queues[stream]
        at = 0 if request_id is None else next(
            (i for i, it in enumerate(q) if it.op.request_id == request_id), 0)
        while q:
            item = q[at]
            op = item.op
            if isinstance(op, FinOp):
                del q[at]
                if ts.order is not None:
                    ts.order.cut(op.request_id, stream, 0, True)
                aux = op.aux
                hdr = HDR.pack(MAGIC, KIND_FIN, int(stream), FLAG_CRC, op.request_id, 0,
                               zlib.crc32(aux), op.total, len(aux))
                return Chunk(op.request_id, [hdr, aux] if aux else [hdr], len(hdr) + len(aux), 0,
                             fin=True)
            n = min(self.policy.chunk_bytes, op.length - item.done)
            view = op.src.slice(op.src_offset + item.done, n)
            flags = 0
            crc = 0
            if op.checksum or ts.peer_requires_checksum:
                if ts.use_xxh3:
                    flags = FLAG_XXH3
                    crc = xxh3_32(view)
                else:
                    flags = FLAG_CRC
                    crc = zlib.crc32(view)
                if self.corrupt is not None:
                    crc = self.corrupt(ts.sid, stream, crc)
            hdr = HDR.pack(MAGIC, KIND_DATA, int(stream), flags, op.request_id, op.dst_region_id,
                           crc, op.dst_offset + item.done, n)
            item.done += n
            if item.done >= op.length:
                del q[at]
            if ts.order is not None:
                ts.order.cut(op.request_id, stream, n, item.done >= op.length)
            return Chunk(op.request_id, [hdr, view], len(hdr) + n, n)
        return None

    def _has_work(self, s: Stream) -> bool:
        return self.ts.current[s] is not None or bool(self.ts.queues[s])

    def run(self) -> None:
        ts = self.ts
        A, R = Stream.ANCHOR, Stream.RESIDUAL
        strict = self.policy.mode == "strict"
        share = self.policy.residual_share
        weight_sent = {A: 0.0, R: 0.0}  # bytes / share, for weighted mode
        throttle = self.throttle
        next_ok = time.monotonic()
        io_timeout = self.io_timeout
        hold = self.hold
        ordered = strict and ts.order is not None
        observed = 0.0
        try:
            while not ts.stop:
                with ts.lock:
                    has = {s: self._has_work(s) for s in STREAMS}
                if ordered and time.monotonic() - observed >= OBSERVE_S:
                    observed = time.monotonic()
                    self._observe(has[A] or has[R])
                if not has[A] and not has[R]:
                    self._wait_wake(OBSERVE_S if ordered and self._delivery_pending()
                                    else io_timeout)
                    continue
                pick = None
                if ordered:
                    choice = self._choose(has)
                    order, pick = [choice.stream], choice.request_id
                    if choice.stream is R and not has[A] and hold >= 0 and _outq(ts.tx[A]) > hold:
                        self._wait_wake(0.0005)  # as below: the Anchor's tail keeps the link
                        continue
                elif strict:
                    order = [A] if has[A] else [R]
                    if not has[A] and hold >= 0 and _outq(ts.tx[A]) > hold:
                        # the ANCHOR's tail is still in the kernel / on the wire: keep the link
                        self._wait_wake(0.0005)
                        continue
                else:
                    cands = [s for s in STREAMS if has[s]]
                    order = sorted(cands, key=lambda s: weight_sent[s])
                if throttle:
                    delay = next_ok - time.monotonic()
                    if delay > 0:
                        time.sleep(min(delay, io_timeout))
                        continue
                if strict and order[0] is A:
                    # ANCHOR: just try (no poll syscall); wait for room only when the kernel
                    # says the socket is full
                    stream = A
                elif (stream := self._wait_writable(order, io_timeout)) is None:
                    # RESIDUAL (and weighted mode) go through poll, which honours
                    # TCP_NOTSENT_LOWAT: a plain send would fill the whole send buffer
                    continue
                with ts.lock:
                    ch = ts.current[stream]
                    if ch is None:
                        ch = ts.current[stream] = self._next_chunk(stream, pick)
                    if ch is None:
                        continue
                limit = 65536 if throttle else (self.res_cap if stream is R else 0)
                sent = self._send_some(ts.tx[stream], ch, limit)
                if sent is None:
                    if stream is A and strict:
                        self._wait_writable([A], io_timeout)
                    continue
                ch.pos += sent
                ts.sent_bytes[stream] += sent
                if throttle:
                    next_ok = max(next_ok, time.monotonic()) + sent / throttle
                if not strict:
                    weight_sent[stream] += sent / (share if stream is R else 1.0 - share)
                    low = min(weight_sent.values())
                    for s in STREAMS:  # forget history while a stream is idle
                        weight_sent[s] = weight_sent[s] - low if has[s] else 0.0
                if ch.pos >= ch.total:
                    with ts.lock:
                        ts.current[stream] = None
                        if ch.fin and ts.order is not None:
                            ts.order.fin_sent(ch.request_id, stream, ts.sent_bytes[stream])
                        ts.lock.notify_all()
                    if ch.payload:
                        self.hooks.sent(ts.sid, ch.request_id, stream, ch.payload)
        except (ConnectionError, OSError) as exc:
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.PEER_DIED, f"send failed: {exc}")
        except Exception as exc:  # pragma: no cover - bug
            log.exception("tcp sender crashed")
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.LOCAL_ERROR, f"sender: {exc!r}")
        finally:
            with ts.lock:
                ts.current = {s: None for s in STREAMS}
                ts.lock.notify_all()

    def _choose(self, has: dict[Stream, bool]) -> Choice:
        """link_order: the next chunk's stream and request (`LinkOrder.choose`)."""
        ts = self.ts
        with ts.lock:
            head = None
            if has[Stream.ANCHOR]:
                ch = ts.current[Stream.ANCHOR]
                head = ch.request_id if ch is not None else ts.queues[Stream.ANCHOR][0].op.request_id
            return ts.order.choose(time.monotonic(), head, has[Stream.RESIDUAL])

    def _observe(self, backlogged: bool) -> None:
        """link_order: tell the order what the peer has acknowledged (sent minus what the
        kernel still holds): the Anchors delivered, and the link's rate."""
        ts = self.ts
        unacked = {s: _outq(ts.tx[s]) for s in STREAMS}
        now = time.monotonic()
        with ts.lock:
            acked = {s: ts.sent_bytes[s] - unacked[s] for s in STREAMS}
            ts.order.acked(acked[Stream.ANCHOR], now)
            ts.order.rate.observe(now, sum(acked.values()), backlogged)

    def _delivery_pending(self) -> bool:
        with self.ts.lock:
            return self.ts.order.pending_delivery()

    def _clear_wake(self) -> None:
        with contextlib.suppress(OSError):
            while self.ts.wake_r.recv(4096):
                pass

    def _wait_wake(self, timeout: float) -> None:
        self._wait_writable([], timeout)

    def _wait_writable(self, order: list, timeout: float) -> Stream | None:
        """First stream of `order` whose socket polls writable within `timeout`, else None; a
        wake-up (new work) ends the wait early. poll(2), not select(2): select refuses any fd
        above 1023, which a process with many sessions or files open reaches. poll's timeout is
        whole milliseconds (rounded up), so the sender's short waits last at least 1 ms."""
        ts = self.ts
        poller = select.poll()
        poller.register(ts.wake_r, select.POLLIN)
        fds = {ts.tx[s].fileno(): s for s in order}
        for fd in fds:
            poller.register(fd, select.POLLOUT)
        ready = dict(poller.poll(timeout * 1000))
        if ts.wake_r.fileno() in ready:
            self._clear_wake()
        # an error counts as writable (as in select): the send then raises and says what it is
        return next((s for fd, s in fds.items() if ready.get(fd, 0) & _SEND_READY), None)

    def _send_some(self, sock: socket.socket, ch: Chunk, limit: int) -> int | None:
        pos = ch.pos
        bufs = []
        for b in ch.bufs:
            n = len(b)
            if pos >= n:
                pos -= n
                continue
            bufs.append(memoryview(b)[pos:] if pos else b)
            pos = 0
        if self.tls:
            # one piece per call, the same piece again after a WANT_WRITE (ch.pos and limit
            # are unchanged then), as OpenSSL requires; an SSL write is all or WANT_WRITE
            piece = memoryview(bufs[0])[: limit or TLS_WRITE_BYTES]
            try:
                return sock.send(piece)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError,
                    InterruptedError):
                return None
        if limit:
            total = 0
            cut = []
            for b in bufs:
                take = min(len(b), limit - total)
                cut.append(memoryview(b)[:take])
                total += take
                if total >= limit:
                    break
            bufs = cut
        try:
            return sock.sendmsg(bufs, (), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
