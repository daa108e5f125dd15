"""Admission limits: how much a peer — authenticated or not — can make an Endpoint hold.

`Limits` is the Endpoint option that gathers every cap on what peers can make us allocate or do
(sessions, handshakes in progress, HELLOs per second per address, bring-up threads, the peer's
pending announcements, the size of one zmq frame); `RateLimiter` is the per-address token bucket
behind the HELLO rate. The control plane's acceptor (`lynx_transport.control_accept`) applies the
handshake limits, the sender role (`lynx_transport.sender`) the announcement cap. The tcp data
listener's limits are tcp backend options (`preamble_timeout_s`, `max_pending_preambles`,
`max_pending_preambles_per_peer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .wire import MAX_HEADER_BYTES


@dataclass(frozen=True)
class Limits:
    """Caps on what peers can make an Endpoint hold (defaults suit a PD cluster of a few hundred
    ranks; raise `max_sessions` for more).

    max_sessions: authenticated sessions at once, both roles (a HELLO or AUTH beyond it is
    refused, busy); handshakes not yet authenticated count against it too, and give way.
    max_handshakes / max_handshakes_per_peer: the pre-authentication budget: handshakes answered
    with a CHALLENGE and not yet authenticated, in all and per peer IP address. A HELLO beyond
    either is answered all the same: it evicts (REJECT, busy) the oldest pending handshake of its
    own address when that address is at its cap, else the oldest of the address holding the most.
    Unanswered HELLOs from any number of addresses can then not lock an honest peer out (its AUTH
    follows its CHALLENGE within a round trip); they only shorten how long theirs are kept.
    auth_timeout_s: the pre-authentication deadline: how long a pending handshake waits for the
    initiator's AUTH, and a control connection for the end of its ZMTP handshake
    (ZMQ_HANDSHAKE_IVL; with a secret, the CURVE proof).
    handshake_timeout_s: how long an authenticated session may take to bring its data path up
    (AUTH to READY).
    hello_rate / hello_burst: HELLOs per second a peer address may send (token bucket); the
    excess is dropped unanswered.
    max_bring_ups: authenticated sessions whose data path is being brought up at once (one
    thread each); more are refused (busy) until one finishes.
    max_peer_announcements: announcements a session's peer may have pending with us (the
    sender); beyond it an ANNOUNCE is answered with ABORT.
    max_peer_announcement_bytes: the memory those announcements may hold, per session
    (`Announcement.footprint`, an estimate): one ANNOUNCE of the largest size holds ~0.9 MiB, so
    the count alone let one authenticated peer make us hold ~3.6 GiB a session. Released ones
    kept for late writes are forgotten first; past it an ANNOUNCE is answered with ABORT.
    max_message_bytes: the largest zmq frame a peer may send (ZMQ_MAXMSGSIZE, plus CURVE's
    framing with a secret: a larger one closes its connection before anything is allocated).
    """

    max_sessions: int = 1024
    max_handshakes: int = 64
    max_handshakes_per_peer: int = 16
    auth_timeout_s: float = 2.0
    handshake_timeout_s: float = 10.0
    hello_rate: float = 20.0
    hello_burst: int = 40
    max_bring_ups: int = 16
    max_peer_announcements: int = 4096
    max_peer_announcement_bytes: int = 32 << 20
    max_message_bytes: int = MAX_HEADER_BYTES

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_handshakes", "max_handshakes_per_peer", "hello_burst",
                     "max_bring_ups", "max_peer_announcements", "max_peer_announcement_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")
        if self.auth_timeout_s <= 0 or self.handshake_timeout_s <= 0 or self.hello_rate <= 0:
            raise ValueError("Limits.auth_timeout_s, handshake_timeout_s and hello_rate must be > 0")
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
