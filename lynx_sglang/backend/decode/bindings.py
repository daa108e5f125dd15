"""Which rank key each prefill rank registered with SGLang's bootstrap server, as this decode last
heard it (`RankBindings`): a session's claim to a prefill rank counts only with that key
(`check`), so a peer that holds the transport secret cannot take a rank, or its rooms, by claiming
it first.

SGLang's receiver looks each prefill rank up at the bootstrap server (rank ip:port, and with Lynx
the rank key: `backend.rank_key`) before it sends the rank anything, so a real prefill never
connects to this decode before its rank was recorded here (`record`, from
`backend.conn.LynxKVReceiver`, SGLang's scheduler thread). A claim whose key differs from the
recorded one may come from a prefill restarted at the same ip:port: the rank is then looked up
again, once per claim and on this module's own `lynx-bind` thread, within `LOOKUP_TIMEOUT_S`
(`DecodeLink.lookup_prefill_rank`); an answer younger than `FRESH_S` is not asked again.

Owned by `backend.decode.applier.DecodeApplier`; asked by its accept thread (`backend.decode.sessions`),
which never waits here: a claim under re-lookup is `PENDING` and asked again on its next round.
`_lock` guards the table and is never held while calling out.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# The longest a re-lookup at the bootstrap server may take.
LOOKUP_TIMEOUT_S = 2.0
# A bootstrap answer this young is taken as it is: a mismatching claim is refused without another
# lookup (claims cannot make this decode query the bootstrap server more often than this per rank).
FRESH_S = 1.0
# Prefill ranks remembered (one more per prefill restart); the least recently looked up go first.
MAX_RANKS = 1024


@dataclass(frozen=True)
class BootstrapSlot:
    """Where SGLang's bootstrap server lists a prefill rank: its address (host:port) and the
    rank's place there (the query of SGLang's `/route` lookup)."""

    bootstrap_addr: str
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class Registration:
    """What the bootstrap server lists at a slot: the rank ip:port and its rank key's public half
    (None: it registered none)."""

    rank: tuple[str, int]
    key: str | None


@dataclass(frozen=True)
class Verdict:
    """A claim's standing: bound (the rank registered this key), pending (a re-lookup runs) or
    refused (why)."""

    pending: bool = False
    refused: str | None = None


BOUND = Verdict()
PENDING = Verdict(pending=True)


@dataclass
class _Binding:
    slot: BootstrapSlot
    key: str | None
    heard: float  # time.monotonic() of the bootstrap server's latest answer
    error: str | None = None  # why the latest re-lookup found no key for the rank
    looking: bool = False  # a re-lookup is running


class RankBindings:
    def __init__(self, lookup: Callable[[BootstrapSlot, float], Registration]):
        self._lookup = lookup  # raises with the reason when the bootstrap server does not answer
        self._lock = threading.Lock()
        self._ranks: OrderedDict[tuple[str, int], _Binding] = OrderedDict()
        self._relookups = ThreadPoolExecutor(1, thread_name_prefix="lynx-bind")

    def record(self, slot: BootstrapSlot, registration: Registration) -> None:
        """What a bootstrap lookup of `slot` answered."""
        with self._lock:
            self._ranks[registration.rank] = _Binding(slot, registration.key, time.monotonic())
            self._ranks.move_to_end(registration.rank)
            while len(self._ranks) > MAX_RANKS:
                self._ranks.popitem(last=False)

    def check(self, rank: tuple[str, int], key: str, arrived: float) -> Verdict:
        """Whether a claim to `rank` with the (proven) `key`, first seen at `arrived`
        (time.monotonic()), is the rank's. Never blocks."""
        where = f"prefill rank {rank[0]}:{rank[1]}"
        with self._lock:
            b = self._ranks.get(rank)
            if b is None:
                return Verdict(refused=f"no bootstrap lookup of this decode named {where} (a "
                                       "decode sends a prefill rank nothing before it looked "
                                       "the rank up)")
            if b.key is not None and hmac.compare_digest(b.key, key):
                return BOUND
            if b.looking:
                return PENDING
            if b.heard < arrived - FRESH_S:
                b.looking = True
                self._relookups.submit(self._relookup, rank, b)
                return PENDING
            registered = (f"registered rank key {b.key[:16]}..." if b.key is not None
                          else "registered no rank key (a prefill of an older Lynx, or a "
                               "bootstrap registry that drops Lynx's field)")
            return Verdict(refused=f"{where} {registered} with the bootstrap server at "
                                   f"{b.slot.bootstrap_addr}, not this session's key "
                                   f"{key[:16]}...{f' ({b.error})' if b.error else ''}")

    def _relookup(self, rank: tuple[str, int], b: _Binding) -> None:
        try:
            found = self._lookup(b.slot, LOOKUP_TIMEOUT_S)
            key = found.key if found.rank == rank else None
            error = None if found.rank == rank else (
                f"the bootstrap server now lists {found.rank[0]}:{found.rank[1]} there")
        except Exception as exc:  # any failure of the lookup: the recorded key stands
            key, error = b.key, f"looking it up again failed: {exc}"
        with self._lock:
            b.key, b.error, b.heard, b.looking = key, error, time.monotonic(), False
        logger.info("lynx: looked prefill rank %s:%d up again at %s: %s", *rank,
                    b.slot.bootstrap_addr, error or "rank key " + (key or "none")[:16])

    def close(self) -> None:
        self._relookups.shutdown(wait=False, cancel_futures=True)
