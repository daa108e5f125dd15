"""The order of the requests that share one link: `LinkOrder`, one per session of the tcp backend
under `PriorityPolicy(link_order=True)`, i.e. one per sender -> receiver link (in Lynx one per
prefill -> decode pair). Pure bookkeeping and decisions: no sockets, no threads, no clock of its
own (every call is given `now`). The session's sender thread (`tcp_send.SendLoop`) tells it what
was queued, cut into chunks and acknowledged, and asks it which request's bytes go next; the
backend (`tcp.TcpBackend`) tells it what was queued and drained, and which request's receiver
now waits on its Residual (rule 6). Every caller holds the session's lock (`TcpSession.lock`),
so it has no lock of its own.

Why: strict priority orders one request's two streams, but across the requests that share a link
it makes every Anchor beat every Residual. Under load a request that already has its Anchor and
now waits on its Residual (Lynx's decode: it speculated up to its cap, or it did not speculate)
waited 1.1-1.6 s behind newer requests' Anchors (issue 59: bench-load at R = 1, 0.1 req/s, time
per output token 179 ms against mooncake-nospin's 111 ms).

The policy (`choose`), at each chunk (`PriorityPolicy.chunk_bytes`):

1. Anchor first within a request: a request's Residual counts as late only once its whole Anchor
   is delivered (the receiving host's TCP acknowledged the Anchor's FIN frame), so it is never
   sent ahead of its own Anchor.
2. A Residual is *late* once it is later than it would be with the link to itself: from its
   Anchor's delivery plus its own bytes' wire time at the link's rate (its byte bound): the
   fallback where the receiver does not signal (rule 6). A sender alone cannot tell a decode
   that speculates from one that waits. Counted from the Anchor's delivery
   alone (the first version), the second bench-load run sent a room's Residual before the next
   room's Anchor 0.5 s after its Anchor landed, while its decode still had 2.5 s of speculative
   tokens to do: the next room's Anchor landed 1.1 s later, for nothing. Past its byte bound a
   Residual is later than the link alone would make it, so it is the one whose decode reaches
   its speculative cap (or waits, not speculating) soonest for what it is owed.
3. Residual against Residual: the requests whose Anchors were delivered first, in that order;
   then the rest by age (their first op queued first), which is the FIFO order the queue had.
4. Residual against Anchor: the Anchors go first (strict), unless the Residual's request R is
   late, the Anchor queue's head is newer than R, and R's lateness is at least the wire time of
   the Anchor bytes of the requests newer than R still queued:
   `now - late_since(R) >= newer_anchor_bytes / rate`. So newer Anchors make a late Residual at
   most twice as late (strict priority let a stream of new Anchors starve it), and a newer
   Anchor is held back only behind Residuals already later than its own wire time. Once R goes
   first it keeps going first until its Residual is all sent: taking turns with the Anchors
   (as the rate estimate moves) would make both later than either order does (in the second run
   the Residual and the Anchor it had overtaken ended together, 1.9 s later). A request is
   *newer* than R when its first op was queued after R's Anchor was ended (its FIN queued): the
   requests a Lynx prefill sends as one group (one forward's) open their Anchors together and end
   them all before any Residual, and keep that order between them (in the first run a group
   mate's Anchor, queued a few ms after R's, waited 2.6 s behind R's Residual); the Anchors of
   requests no newer keep their place.
5. The rate: this link's delivered bytes per second (bytes the peer's TCP acknowledged, over
   windows of at least `RATE_WINDOW_S` in which the sender had bytes queued the whole time),
   a running average (`LinkRate`). Measured per link, not per request: requests share it. Until
   it is measured nothing is late (strict order).

The decode's signal (rule 6). A decode that parks a request at its speculative cap, or decided
not to speculate, knows when the Residual becomes urgent; the sender alone can only guess (rule
2), and its guess was wrong both ways (above). So the receiver may announce a request with
`signals_waiting` and then send WAITING(request_id) when its tokens wait on the Residual
(`Session.mark_waiting`; a control message, authenticated like every other, its frame checked by
size and field before it touches anything, taken by the sender's session only for a request it
is sending with the Residual pending and announced so, at most once, anything else dropped and
counted `waiting_dropped_*`; `TcpBackend.waiting` hands it here):

6. A request announced with `signals_waiting` (`Room.signalled`) is late from the arrival of
   its WAITING (`waiting`), never by rule 2's guess: not before it (newer Anchors go first while
   its decode still has speculative tokens to do), and as soon as it comes (no byte bound to
   wait out where its decode does not speculate). Rule 4 then weighs that lateness as before;
   until the link's rate is measured, a waiting Residual goes before newer Anchors only when
   none of their bytes are queued. Among Residuals the waiting ones go first, in the order their
   WAITINGs came (rule 3 for the rest). A request announced without it (an older decode, a
   windowed room) keeps rule 2's guess.

Not built: incast. One decode fed by several prefills is the only place that sees their links
compete; it would send WAITING for its longest-parked request to every prefill whose Anchors
share its NIC, each prefill then holding its own newer Anchors behind it by rule 4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import Stream

# A rate sample needs the sender backlogged for at least this long: shorter windows see the
# kernel's buffering (bursts of acknowledgements), not the link.
RATE_WINDOW_S = 0.1
# Weight of a new rate sample (a few windows follow a change; one outlier does not flip it).
RATE_EWMA = 0.3
# ... of a sample below the estimate: a rate too high makes Residuals late too soon (rule 2) and
# sends them before newer Anchors for good (rule 4); a session outlives a link's change (the
# benchmarks shape the link slower after calibrating at 1 Gbit/s).
RATE_EWMA_SLOWER = 0.7


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
    anchor_done_at: float | None = None  # delivered (rules 1 and 2)
    residual_bytes: int = 0  # its Residual's bytes queued so far (rule 2's byte bound)
    promoted: bool = False  # its Residual went before newer Anchors: it stays first (rule 4)
    signalled: bool = False  # its receiver says when it waits (rule 6): no guess
    waiting_at: float | None = None  # its receiver's WAITING arrived (rule 6)

    def has(self, stream: Stream) -> bool:
        return self.queued[stream].ops > 0


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
        if self.bps is None:
            self.bps = sample
        else:
            weight = RATE_EWMA_SLOWER if sample < self.bps else RATE_EWMA
            self.bps += weight * (sample - self.bps)


class LinkOrder:
    """The requests queued on one link and the order their chunks go in (see the module)."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}  # by request id, in the order they were first queued
        self.rate = LinkRate()

    # ------------------------------------------------------------------ what happened
    def queued(self, request_id: int, stream: Stream, nbytes: int, now: float,
               fin: bool = False, signalled: bool = False) -> None:
        """An op was queued on `stream`: a write of `nbytes`, or (`fin`) the stream's FIN;
        `signalled`: the request was announced with `signals_waiting` (rule 6)."""
        room = self.rooms.get(request_id)
        if room is None:
            room = self.rooms[request_id] = Room(request_id, now, signalled=signalled)
        if fin and stream is Stream.ANCHOR and room.anchor_ended_at is None:
            room.anchor_ended_at = now
        if stream is Stream.RESIDUAL:
            room.residual_bytes += nbytes
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

    def waiting(self, request_id: int, now: float) -> bool:
        """The request's receiver waits on its Residual from `now` (rule 6: its WAITING, which
        the session took once). False where it changes nothing: no Residual of the request is
        left here (all of it handed to the kernel), or it was told already."""
        room = self.rooms.get(request_id)
        if room is None or room.waiting_at is not None:
            return False
        room.waiting_at = now
        return True

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
            self.rooms[pick].promoted = True
            return Choice(Stream.RESIDUAL, pick)
        return Choice(Stream.ANCHOR)

    def late_since(self, room: Room) -> float | None:
        """When the room's Residual became late: its WAITING's arrival (rule 6), else rule 2's
        guess, when it became later than its byte bound (None: not known to be late: not
        waiting where its receiver signals, its Anchor not delivered, or the link's rate not
        measured)."""
        if room.waiting_at is not None:
            return room.waiting_at
        if room.signalled or room.anchor_done_at is None or self.rate.bps is None:
            return None
        return room.anchor_done_at + room.residual_bytes / self.rate.bps

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
        if room.promoted:
            return True
        since, ended = self.late_since(room), room.anchor_ended_at
        head = self.rooms.get(anchor_head)
        if since is None or ended is None or head is None:
            return False
        if head.first_at <= ended:
            return False  # the head is no newer: strict
        newer = sum(r.queued[Stream.ANCHOR].nbytes for r in self.rooms.values()
                    if r.first_at > ended)
        if self.rate.bps is None:  # only a WAITING makes a room late before the rate is known
            return newer == 0
        return now - since >= newer / self.rate.bps


def _residual_key(room: Room) -> tuple[int, float]:
    """Rule 3's order, with rule 6's first: waiting (by their WAITING); Anchors delivered, in
    that order; then oldest."""
    if room.waiting_at is not None:
        return (0, room.waiting_at)
    done = room.anchor_done_at
    return (1, done) if done is not None else (2, room.first_at)
