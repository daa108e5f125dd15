"""The decode's transport sessions from prefill ranks (`PrefillSessions`), each registered by the
SGLang identity (rank ip:port) and wire settings its prefill announces as the empty request
`IDENTITY_REQUEST` (`backend.identity`, both ends of the handshake), answered accepted or refused.
A claim to a rank counts only when it is signed with the rank key SGLang's bootstrap server lists
for that rank (`backend.rank_key`, `backend.decode.bindings`), and that is checked before anything
else: another claim is refused and changes nothing, so a peer holding the transport secret can
neither take a rank's rooms nor get the real rank refused by claiming it first. A rank already
served by a live session is never silently taken over by another; a rank whose settings differ
from ours is remembered as refused, so that its rooms fail at once, saying why.

Runs the accept thread (`accept_loop`, started by the manager through
`DecodeApplier.accept_loop`); read by `StagingAdmission` (the session to announce a room on) and by
the applier thread (refused ranks, sessions that ended). `_lock` guards the two maps and is never
held while calling out (a lock taken after the room table's, never before it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lynx_transport import Endpoint, Session

from ...config import LynxConfig, wire_mismatch
from ..identity import IDENTITY_REQUEST, Identity, answer
from ..rank_key import proven
from .bindings import PENDING, RankBindings, Verdict

logger = logging.getLogger(__name__)

# A prefill rank that connected but has not named itself within this long is dropped.
IDENTITY_TIMEOUT_S = 10.0
# A refused session is closed this long after its answer, so the answer arrives before the
# connection drops (the prefill closes it itself once it has read the answer).
REFUSED_CLOSE_DELAY_S = 2.0


class PrefillSessions:
    def __init__(self, config: LynxConfig, endpoint: Endpoint, bindings: RankBindings,
                 wake: Callable[[], None]):
        self.config = config
        self.endpoint = endpoint
        self.bindings = bindings
        self._wake = wake  # the applier thread: a rank's rooms may be announced (or fail) now
        self._lock = threading.Lock()
        self._sessions: dict[tuple[str, int], Session] = {}
        # Prefill ranks whose wire settings differ from ours, with the reason their rooms fail.
        self._refused: dict[tuple[str, int], str] = {}
        self._closing: list[tuple[Session, float]] = []  # refused sessions (accept thread only)

    def get(self, rank: tuple[str, int]) -> Session | None:
        """The session registered for the prefill rank (it may have closed since)."""
        with self._lock:
            return self._sessions.get(rank)

    def refused(self, rank: tuple[str, int]) -> str | None:
        """Why the prefill rank's session was refused, if it was (and no session of it was
        accepted since)."""
        with self._lock:
            return self._refused.get(rank)

    def forget_dead(self) -> list[tuple[str, int]]:
        """Forget the ranks whose session ended (it died, or stalled past the heartbeat), and
        return them."""
        with self._lock:
            dead = [rank for rank, s in self._sessions.items() if s.closed]
            for rank in dead:
                del self._sessions[rank]
        return dead

    # ---- the accept thread --------------------------------------------------------------------
    def accept_loop(self, stop: threading.Event) -> None:
        """Register each prefill rank's session by the identity it announces. Sessions are
        checked without blocking, so a silent or malformed peer never delays another."""
        try:
            self._serve(stop)
        finally:
            self.bindings.close()

    def _serve(self, stop: threading.Event) -> None:
        waiting: list[tuple[Session, float]] = []  # with when each came
        while not stop.is_set():
            s = self.endpoint.accept(timeout=0.1 if waiting or self._closing else 0.5)
            due = [c for c in self._closing if c[1] <= time.monotonic()]
            for refused, _ in due:
                refused.close()
            self._closing = [c for c in self._closing if c not in due]
            if s is not None:
                waiting.append((s, time.monotonic()))
            still = []
            for session, arrived in waiting:
                try:
                    done = self._identify(session, arrived)
                except Exception:
                    logger.exception("lynx: identifying the session from %s failed",
                                     session.peer_address)
                    done = True
                if not done:
                    still.append((session, arrived))
            waiting = still

    def _identify(self, s: Session, arrived: float) -> bool:
        """True once `s` (accepted at `arrived`, time.monotonic()) is registered or refused
        (closed)."""
        if s.closed:
            return True
        deadline = arrived + IDENTITY_TIMEOUT_S
        ann = s.announcement(IDENTITY_REQUEST)
        if ann is None:
            if time.monotonic() < deadline:
                return False
            logger.error("lynx: session from %s named no prefill rank within %g s; closed",
                         s.peer_address, IDENTITY_TIMEOUT_S)
            s.close()
            return True
        who = Identity.parse(ann.meta)
        if who is None:
            logger.error("lynx: session from %s sent a malformed identity %r; closed",
                         s.peer_address, bytes(ann.meta[:200]))
            s.close()
            return True
        key = who.rank
        verdict = self._bound(s, who, arrived)
        if verdict is PENDING:
            if time.monotonic() < deadline:
                return False
            verdict = Verdict(refused=f"the bootstrap server did not confirm prefill rank "
                                      f"{key[0]}:{key[1]} within {IDENTITY_TIMEOUT_S:g} s")
        if verdict.refused is not None:
            logger.error("lynx: session from %s claims prefill rank %s:%d, refused: %s",
                         s.peer_address, *key, verdict.refused)
            self._refuse(s, f"the claim to prefill rank {key[0]}:{key[1]} was refused: "
                            f"{verdict.refused}")
            return True
        differ = wire_mismatch(self.config.wire_settings(), who.settings)
        if differ:
            why = (f"prefill rank {key[0]}:{key[1]} runs other --lynx-* settings than this decode "
                   f"({'; '.join(differ)}): give both servers the same flags")
            if self.refused(key) != why:
                logger.error("lynx: %s; its session from %s is closed and its requests fail",
                             why, s.peer_address)
            with self._lock:
                self._refused[key] = why
            self._refuse(s, why)
            self._wake()
            return True
        with self._lock:
            self._refused.pop(key, None)
            current = self._sessions.get(key)
            if current is not None and not current.closed and current is not s:
                taken = True
            else:
                taken = False
                self._sessions[key] = s
        if taken:
            logger.error("lynx: session from %s claims prefill rank %s:%d, which a live session "
                         "already serves; closed", s.peer_address, *key)
            s.close()
            return True
        answer(s, None)
        logger.info("lynx: transport session from prefill rank %s:%d", *key)
        self._wake()
        return True

    def _bound(self, s: Session, who: Identity, arrived: float) -> Verdict:
        """Whether `who`, announced on `s`, proves the rank key the bootstrap server lists for
        its rank."""
        if not proven(who, self.endpoint.address, s.channel_binding):
            return Verdict(refused="it is not signed with the rank key it names for this session "
                                   "(a replayed claim, or a prefill of an older Lynx)")
        return self.bindings.check(who.rank, who.key, arrived)

    def _refuse(self, s: Session, why: str) -> None:
        """Tell the peer why, and close its session once the answer had time to arrive."""
        answer(s, why)
        self._closing.append((s, time.monotonic() + REFUSED_CLOSE_DELAY_S))
