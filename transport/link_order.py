"""The order of the requests that share one link: `LinkOrder`, one per session of the tcp backend
under `PriorityPolicy(link_order=True)`, i.e. one per sender -> receiver link (in Lynx one per
prefill -> decode pair). Pure bookkeeping and decisions: no sockets, no threads, no clock of its
own (every call is given `now`). The session's sender thread (`tcp_send.SendLoop`) tells it what
was queued, cut into chunks and acknowledged, and asks it which request's bytes go next; the
backend (`tcp.TcpBackend`) tells it what was queued and drained. Every caller holds the session's
lock (`TcpSession.lock`), so it has no lock of its own.

Why: strict priority orders one request's two streams, but across the requests that share a link
it makes every Anchor beat every Residual. Under load a request that already has its Anchor and
now waits on its Residual (Lynx's decode: it speculated up to its cap, or it did not speculate)
waited 1.1-1.6 s behind newer requests' Anchors (issue 59: bench-load at R = 1, 0.1 req/s, time
per output token 179 ms against mooncake-nospin's 111 ms).

The policy (`choose`), at each chunk (`PriorityPolicy.chunk_bytes`):

1. Anchor first within a request: a request's Residual counts as waiting only once its whole
   Anchor is delivered, so it is never sent ahead of its own Anchor.
2. A request is *waiting* from the moment its Anchor is delivered: the receiving host's TCP has
   acknowledged the Anchor's last byte (its FIN frame). A sender cannot tell a decode that
   speculates from one that waits; one that did not speculate waits from then on, and one that
   speculates has tokens to do but will stop at its cap, so counting its wait from there and
   letting rule 4 weigh it is the safe side.
3. Residual against Residual: the waiting requests first, the one waiting longest first; among
   requests not waiting, the oldest (its first byte queued first), which is the FIFO order the
   queue already had.
4. Residual against Anchor: the Anchors go first (strict), unless the Residual's request R is
   waiting, the Anchor queue's head is newer than R, and R has waited at least as long as the
   Anchor bytes of the requests newer than R still queued would take on this link:
   `now - waiting_since(R) >= newer_anchor_bytes / rate`. So newer Anchors hold a waiting
   Residual back at most as long as it has already waited (its wait at most doubles for them,
   where strict priority let a stream of new Anchors starve it), and a newer Anchor is held back
   only behind Residuals that have waited longer than its own wire time. A request is *newer*
   than R when its first op was queued after R's Anchor was ended (its FIN queued): the requests
   a Lynx prefill sends as one group (one forward's) open their Anchors together and end them all
   before any Residual, and keep that order between them (in the first bench-load run a group
   mate's Anchor, queued a few ms after R's, waited 2.6 s behind R's Residual and its TTFT grew
   by 2 s); the Anchors of requests no newer keep their place.
5. The rate: this link's delivered bytes per second (bytes the peer's TCP acknowledged, over
   windows of at least `RATE_WINDOW_S` in which the sender had bytes queued the whole time),
   a running average (`LinkRate`). Measured per link, not per request: requests share it. Until
   it is measured, rule 4 never fires (strict order).

Not built: a signal from the decode. A decode that parks a request at its speculative cap (or
decides not to speculate) knows when the Residual becomes urgent, and one decode fed by several
prefills is the only place that sees their links compete. The design: a small control message
receiver -> sender, `WAITING(request_id)`, authenticated like every control message and accepted
only for a request with a live send record on that session, at most once per request (anything
else is dropped and counted), which sets the request's `waiting_since` to its arrival (earlier
than rule 2's guess only where the decode did not speculate; later where it did, so newer
Anchors go first while its speculation still has tokens to do); for incast, the decode would
send `WAITING` for its longest-waiting request to every prefill whose Anchors share its NIC,
each prefill then holding its own newer Anchors behind it by rule 4 with the decode's word in
place of its own age.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import Stream

# A rate sample needs the sender backlogged for at least this long: shorter windows see the
# kernel's buffering (bursts of acknowledgements), not the link.
RATE_WINDOW_S = 0.1
# Weight of a new rate sample (a few windows follow a change; one outlier does not flip it).
RATE_EWMA = 0.3


@dataclass
class _Queued:
    """One request's work queued on one stream: bytes not yet cut into chunks, ops not yet
    taken off the queue (a FIN counts as an op of no bytes)."""

    nbytes: int = 0
    ops: int = 0


@dataclass
class Room:
    """What the link knows of one request (a "room" in Lynx)."""

    request_id: int
    first_at: float  # its first op queued: its age
    anchor_ended_at: float | None = None  # its Anchor's FIN queued: later requests are newer
    queued: dict[Stream, _Queued] = field(
        default_factory=lambda: {Stream.ANCHOR: _Queued(), Stream.RESIDUAL: _Queued()})
    # The Anchor's FIN frame was handed to the kernel once the Anchor socket had sent this many
    # bytes in all: the Anchor is delivered once the peer has acknowledged as many.
    anchor_mark: int | None = None
    anchor_done_at: float | None = None  # delivered (rule 2): waiting from then

    def has(self, stream: Stream) -> bool:
        return self.queued[stream].ops > 0

    @property
    def waiting_since(self) -> float | None:
        return self.anchor_done_at


@dataclass(frozen=True)
class Choice:
    """The stream whose next chunk goes, and whose request's chunk (None: the queue's head)."""

    stream: Stream
    request_id: int | None = None


class LinkRate:
    """A link's delivered bytes per second (rule 5): `observe` the running count of bytes the
    peer has acknowledged; a sample is taken over each window of at least `RATE_WINDOW_S` in
    which the sender stayed backlogged."""

    def __init__(self) -> None:
        self.bps: float | None = None
        self._start: tuple[float, int] | None = None  # (time, delivered) of the open window

    def observe(self, now: float, delivered: int, backlogged: bool) -> None:
        if not backlogged:
            self._start = None  # an idle link says nothing of its rate
            return
        if self._start is None:
            self._start = (now, delivered)
            return
        t0, d0 = self._start
        if now - t0 < RATE_WINDOW_S:
            return
        sample = (delivered - d0) / (now - t0)
        self._start = (now, delivered)
        if sample <= 0:
            return  # nothing acknowledged over a backlogged window: a stall, not a rate
        self.bps = sample if self.bps is None else self.bps + RATE_EWMA * (sample - self.bps)


class LinkOrder:
    """The requests queued on one link and the order their chunks go in (see the module)."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}  # by request id, in the order they were first queued
        self.rate = LinkRate()

    # ------------------------------------------------------------------ what happened
    def queued(self, request_id: int, stream: Stream, nbytes: int, now: float,
               fin: bool = False) -> None:
        """An op was queued on `stream`: a write of `nbytes`, or (`fin`) the stream's FIN."""
        room = self.rooms.get(request_id)
        if room is None:
            room = self.rooms[request_id] = Room(request_id, now)
        if fin and stream is Stream.ANCHOR and room.anchor_ended_at is None:
            room.anchor_ended_at = now
        q = room.queued[stream]
        q.nbytes += nbytes
        q.ops += 1

    def cut(self, request_id: int, stream: Stream, nbytes: int, op_done: bool) -> None:
        """`nbytes` of the request's head op on `stream` became a chunk (`op_done`: the op left
        the queue with it)."""
        room = self.rooms.get(request_id)
        if room is None:
            return
        q = room.queued[stream]
        q.nbytes = max(q.nbytes - nbytes, 0)
        if op_done:
            q.ops = max(q.ops - 1, 0)

    def fin_sent(self, request_id: int, stream: Stream, mark: int) -> None:
        """The request's FIN on `stream` was handed to the kernel, `mark` bytes into that
        stream's socket. A finished Residual ends the request's life here (whatever of it is
        still in flight is the kernel's)."""
        room = self.rooms.get(request_id)
        if room is None:
            return
        if stream is Stream.RESIDUAL:
            del self.rooms[request_id]
        elif room.anchor_mark is None:
            room.anchor_mark = mark

    def acked(self, anchor_acked: int, now: float) -> None:
        """The peer has acknowledged `anchor_acked` bytes of the Anchor socket in all: every
        Anchor whose FIN lies within them is delivered (rule 2)."""
        for room in self.rooms.values():
            if (room.anchor_done_at is None and room.anchor_mark is not None
                    and anchor_acked >= room.anchor_mark):
                room.anchor_done_at = now

    def pending_delivery(self) -> bool:
        """Some Anchor was handed over whole but is not known delivered yet."""
        return any(r.anchor_mark is not None and r.anchor_done_at is None
                   for r in self.rooms.values())

    def drained(self, request_id: int, stream: Stream | None) -> None:
        """The request's queued ops were dropped (`stream`'s only, if given); the whole request
        is forgotten."""
        if stream is None:
            self.rooms.pop(request_id, None)
            return
        room = self.rooms.get(request_id)
        if room is not None:
            room.queued[stream] = _Queued()

    # ------------------------------------------------------------------ what goes next
    def choose(self, now: float, anchor_head: int | None, residual_work: bool) -> Choice:
        """The next chunk, given the Anchor queue's head request (None: no Anchor work) and
        whether any Residual work is queued (rules 3 and 4)."""
        if not residual_work:
            return Choice(Stream.ANCHOR)
        pick = self.residual_next()
        if anchor_head is None:
            return Choice(Stream.RESIDUAL, pick)
        if pick is not None and self.residual_first(now, self.rooms[pick], anchor_head):
            return Choice(Stream.RESIDUAL, pick)
        return Choice(Stream.ANCHOR)

    def residual_next(self) -> int | None:
        """The request whose Residual goes next (rule 3); None: none known (the queue's head)."""
        best: Room | None = None
        for room in self.rooms.values():
            if not room.has(Stream.RESIDUAL):
                continue
            if best is None or _residual_key(room) < _residual_key(best):
                best = room
        return None if best is None else best.request_id

    def residual_first(self, now: float, room: Room, anchor_head: int) -> bool:
        """Rule 4: does `room`'s Residual go before the Anchor queue headed by `anchor_head`?"""
        since, ended = room.waiting_since, room.anchor_ended_at
        head = self.rooms.get(anchor_head)
        if since is None or ended is None or self.rate.bps is None or head is None:
            return False
        if head.first_at <= ended:
            return False  # the head is no newer: strict
        newer = sum(r.queued[Stream.ANCHOR].nbytes for r in self.rooms.values()
                    if r.first_at > ended)
        return now - since >= newer / self.rate.bps


def _residual_key(room: Room) -> tuple[int, float]:
    """Rule 3's order: waiting first, longest waiting first; then oldest."""
    since = room.waiting_since
    return (0, since) if since is not None else (1, room.first_at)
