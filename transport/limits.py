"""Admission limits: how much a peer — authenticated or not — can make an Endpoint hold.

`Limits` is the Endpoint option that gathers every cap on what peers can make us allocate or do
(sessions, handshakes in progress, HELLOs per second per address, bring-up threads, the peer's
pending announcements, the size of one zmq frame); `RateLimiter` is the per-address token bucket
behind the HELLO rate. The control plane (`lynx_transport.control`) applies the handshake limits,
the sender role (`lynx_transport.sender`) the announcement cap. The tcp data listener's limits are
tcp backend options (`preamble_timeout_s`, `max_pending_preambles`, `max_pending_preambles_per_peer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .wire import MAX_HEADER_BYTES


@dataclass(frozen=True)
class Limits:
    """Caps on what peers can make an Endpoint hold (defaults suit a PD cluster of a few hundred
    ranks; raise `max_sessions` for more).

    max_sessions: sessions at once, in handshake or established, both roles.
    max_handshakes / max_handshakes_per_peer: handshakes answered with a CHALLENGE and not yet
    authenticated, in all and per peer IP address; they are dropped after `handshake_timeout_s`.
    handshake_timeout_s: how long an accepted session may take from HELLO to READY.
    hello_rate / hello_burst: HELLOs per second a peer address may send (token bucket); the
    excess is dropped unanswered.
    max_bring_ups: authenticated sessions whose data path is being brought up at once (one
    thread each); more are refused (busy) until one finishes.
    max_peer_announcements: announcements a session's peer may have pending with us (the
    sender); beyond it an ANNOUNCE is answered with ABORT.
    max_message_bytes: the largest zmq frame a peer may send (ZMQ_MAXMSGSIZE: a larger one
    closes its connection before anything is allocated).
    """

    max_sessions: int = 1024
    max_handshakes: int = 64
    max_handshakes_per_peer: int = 16
    handshake_timeout_s: float = 10.0
    hello_rate: float = 20.0
    hello_burst: int = 40
    max_bring_ups: int = 16
    max_peer_announcements: int = 4096
    max_message_bytes: int = MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_handshakes", "max_handshakes_per_peer", "hello_burst",
                     "max_bring_ups", "max_peer_announcements"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")
        if self.handshake_timeout_s <= 0 or self.hello_rate <= 0:
            raise ValueError("Limits.handshake_timeout_s and hello_rate must be > 0")
        if self.max_message_bytes < MAX_HEADER_BYTES:
            raise ValueError(f"Limits.max_message_bytes must be >= {MAX_HEADER_BYTES} (the "
                             "largest header this protocol sends)")


class RateLimiter:
    """Token buckets keyed by peer address: `allow(key, t)` spends a token if one is left. The
    table holds at most `max_keys` addresses; full (idle) buckets are forgotten first, since a
    forgotten address starts again with a full bucket anyway. Used by the control thread only."""

    def __init__(self, rate: float, burst: int, max_keys: int = 4096):
        self._rate = rate
        self._burst = float(burst)
        self._max_keys = max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, time)

    def allow(self, key: str, t: float) -> bool:
        tokens, last = self._buckets.pop(key, (self._burst, t))
        tokens = min(self._burst, tokens + (t - last) * self._rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        if len(self._buckets) >= self._max_keys:
            self._evict(t)
        self._buckets[key] = (tokens, t)  # re-inserted last: dict order is least recent first
        return ok

    def _evict(self, t: float) -> None:
        refill = self._burst / self._rate
        for k in [k for k, (_, last) in self._buckets.items() if t - last >= refill]:
            del self._buckets[k]
        while len(self._buckets) >= self._max_keys:
            del self._buckets[next(iter(self._buckets))]
