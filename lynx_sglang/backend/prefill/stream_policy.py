"""Whether a room's Anchor is layer-streamed (sent while the prefill forward computes) or sent
after the forward: `StreamPolicy`, one per prefill sender.

Layer streaming hides the Anchor's wire time under the forward, but its encode runs beside the
forward and takes CPU from it (and where the decode shares the box, so does its apply). Where the
link is fast against the forward there is nothing to hide and only that cost is left: on this
project's 2-core box at 5 Gbit/s (R ≈ 0.01) a streamed 1500-token request's forward took ~25 %
longer (TTFT from the send 5.16 s against mooncake-nospin's 4.08 s; sent after the forward,
3.6-4.4 s), for an Anchor whose whole wire time was 16 ms. So a room is streamed only where
sending after the forward would delay it by at least `min_share` of its forward: the Anchor's
post-forward delivery (encode and wire, per byte, measured on this decode's earlier rooms sent
after their forward) times this room's Anchor bytes, against this forward's predicted time
(seconds per prompt token of the earlier forwards).

The first room to a decode, and while its rooms are streamed (which measure nothing about the
link) one once `PROBE_EVERY_S` and `PROBE_EVERY_ROOMS` streamed rooms have passed, goes after its
forward to measure the link ("probe"); a room
whose forward was never timed is streamed. `min_share` 0 streams every room.

Called by the scheduler thread (`decide`, `observe_forward`) and by the destination workers
(`observe_anchor`, from the transport's delivery times; `link_s_per_byte` and `forward_s` for the
Anchor's width, `backend.prefill.anchor_width`); one lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

# How long a decode's link measurement is trusted while its rooms are streamed: then one room
# goes after its forward again, so that a link that got faster is noticed.
PROBE_EVERY_S = 300.0
# ... and at least this many of its rooms streamed since: a probe costs its room the Anchor's
# whole wire time (at R = 16 here, 3 s of a 17.7 s TTFT), and at a few requests a minute a probe
# every 5 minutes was 1 room in 2-5 of a benchmark's; now at most 1 in 32 pays.
PROBE_EVERY_ROOMS = 32
# Weight of a new measurement in the running estimates (a few rooms to follow a change, one
# outlier does not flip the decision).
EWMA = 0.3
# A link measured slower than its estimate weighs more: sending after the forward on a slow link
# costs the Anchor's whole wire time, streaming on a fast one only the encode's share of the
# forward. (At 0.3 a link slowed from 1 Gbit/s to 51 Mbit/s moved its estimate from 0.02 to 0.11
# of the forward in one room: barely past the 0.1 default.)
EWMA_SLOWER = 0.7
# Forwards of fewer prompt tokens are not timed: their fixed cost dominates (a 1-token health
# check took ~30x a long prompt's time per token), and timed they made a 1500-token forward look
# ten times longer than it was, so that no room was streamed at R = 1.
MIN_TIMED_TOKENS = 128
# Decodes whose links (and last answers) are remembered: their addresses come from SGLang's
# bootstrap, so a decode restarted on new ports (or a peer naming many) must not grow the tables
# without bound; the least recently measured is forgotten (it is probed again if it comes back).
MAX_LINKS = 1024


@dataclass(frozen=True)
class Decision:
    stream: bool
    why: str
    # The answer differs from the last one for this decode (or is the first): worth a log line.
    changed: bool = False


@dataclass
class _Link:
    s_per_byte: float  # an Anchor's post-forward delivery time per byte
    measured_at: float  # monotonic
    streamed: int = 0  # rooms streamed since (they measure nothing of the link)


class StreamPolicy:
    """Layer streaming room by room (see the module). `min_share` 0: always stream."""

    def __init__(self, min_share: float, clock=time.monotonic):
        if min_share < 0:
            raise ValueError(f"min_share must be >= 0, got {min_share}")
        self.min_share = min_share
        self._clock = clock
        self._lock = threading.Lock()
        self._s_per_token: float | None = None
        self._links: dict[str, _Link] = {}
        self._last: dict[str, bool] = {}  # the last answer per decode, least recent first

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """An extend forward of `tokens` prompt tokens took `seconds` (short ones are left out:
        MIN_TIMED_TOKENS)."""
        if tokens < MIN_TIMED_TOKENS or seconds <= 0:
            return
        rate = seconds / tokens
        with self._lock:
            old = self._s_per_token
            self._s_per_token = rate if old is None else old + EWMA * (rate - old)

    def observe_anchor(self, decode: str, nbytes: int, seconds: float) -> None:
        """A room sent after its forward had its `nbytes` Anchor delivered to `decode`
        `seconds` after the room was ready to send."""
        if nbytes <= 0 or seconds < 0:
            return
        rate = seconds / nbytes
        with self._lock:
            old = self._links.get(decode)
            if old is None:
                value = rate
            else:
                weight = EWMA_SLOWER if rate > old.s_per_byte else EWMA
                value = old.s_per_byte + weight * (rate - old.s_per_byte)
            self._links.pop(decode, None)
            self._links[decode] = _Link(value, self._clock())  # last: the most recently measured
            while len(self._links) > MAX_LINKS:
                del self._links[next(iter(self._links))]

    def link_s_per_byte(self, decode: str) -> float | None:
        """The running estimate of an Anchor's post-forward delivery time per byte to `decode`
        (None: not measured)."""
        with self._lock:
            link = self._links.get(decode)
            return None if link is None else link.s_per_byte

    def forward_s(self, tokens: int) -> float | None:
        """The predicted time of a forward of `tokens` prompt tokens (None: none timed yet)."""
        with self._lock:
            return None if self._s_per_token is None else self._s_per_token * tokens

    def decide(self, decode: str, anchor_bytes: int, tokens: int) -> Decision:
        """Stream this room's Anchor to `decode`, or send it after the forward? `changed` says
        whether that differs from the last answer for `decode`."""
        d = self._decide(decode, anchor_bytes, tokens)
        with self._lock:
            changed = self._last.pop(decode, None) != d.stream
            self._last[decode] = d.stream
            while len(self._last) > MAX_LINKS:
                del self._last[next(iter(self._last))]
        return replace(d, changed=changed)

    def _decide(self, decode: str, anchor_bytes: int, tokens: int) -> Decision:
        if self.min_share == 0:
            return Decision(True, "always (--lynx-layer-stream-min-share 0)")
        with self._lock:
            link = self._links.get(decode)
            if link is None:
                return Decision(False, "probe: this decode's link not measured yet")
            if (self._clock() - link.measured_at > PROBE_EVERY_S
                    and link.streamed >= PROBE_EVERY_ROOMS):
                # Sent after the forward, the room measures the link again (observe_anchor).
                link.measured_at, link.streamed = self._clock(), 0
                return Decision(False, f"probe: link last measured over {PROBE_EVERY_S:g} s and "
                                       f"{PROBE_EVERY_ROOMS} streamed rooms ago")
            if self._s_per_token is None:
                link.streamed += 1
                return Decision(True, "no forward timed yet")
            after = link.s_per_byte * anchor_bytes
            forward = self._s_per_token * tokens
            share = after / forward
            if share >= self.min_share:
                link.streamed += 1
                return Decision(True, f"the Anchor after the forward would take {after:.3f} s, "
                                      f"{share:.2f} of the forward's {forward:.2f} s")
        return Decision(False, f"the Anchor after the forward takes {after:.3f} s, only "
                               f"{share:.2f} of the forward's {forward:.2f} s")
