"""The decode side of the `lynx` backend (`DecodeApplier`): announces each request's staging range
to its prefill rank's transport session and puts the landed streams into the KV pool, layer by
layer as the bytes land. It is the loop over the parts that do the work, and SGLang's interface to
them:

- `RoomTable` (`backend.decode.rooms`): every room ("room", a `backend.decode.room.DecodeRoom`) not yet
  forgotten, and which the applier thread is working on;
- `PrefillSessions` (`backend.decode.sessions`): the accept thread (`accept_loop`) registers each
  prefill rank's session by the identity it announces, or refuses it;
- `StagingAdmission` (`backend.decode.admission`): `register` and `staged` (SGLang's scheduler
  thread, from the receiver), the staging queue, announcing, and giving the range back;
- `StreamApplier` / `WindowedApplier` (`backend.decode.apply`, `backend.decode.windowed`): the
  applier thread (`run`) applies what has landed, and decides at Anchor time whether speculating
  pays (`backend.decode.policy`). Speculative: Success is reported then, SGLang decodes on the
  Anchor, and the room stays here until the speculation controller has read its Residual outcome
  (`residual_outcome`, `forget`; it says when it parks the request, `waiting`). A room waits on
  its Residual once it decided not to speculate, or once the controller parked it: then its
  prefill is told (`Session.mark_waiting`, for its link order);
- `StatusReporter` (`backend.decode.report`): every status that reaches SGLang.

Given by `backend.manager.LynxKVManager`: the pool view, the staging pool and its region, the
transport endpoint, the config, `DecodeLink` (the one status report to SGLang, the aux writer,
and the bootstrap-cache eviction of a dead prefill rank), and the process's recorder (each room's
trace record and the transfer metrics).

Locking: the table's lock guards the rooms and their states, and is never held while bytes are
applied. A room being applied is marked so; `cancel` and `drop` wait for that room's work to end
before they return (a barrier: nothing is written into its slots afterwards), without ever waiting
for another room. Buffer ownership: a room's staging range is the applier's from `register` until
`StagingAdmission.release`, which first withdraws the announcement (no byte lands after it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from lynx_transport import Endpoint, Region

from ...config import LynxConfig
from ...failures import FailureKind, failure_kind_of
from ...recorder import Recorder
from ..pool import KVPoolView
from ..staging import StagingPool
from .admission import StagingAdmission
from .apply import ApplyDeps, StreamApplier
from .bindings import RankBindings
from .outcome import ResidualOutcome
from .policy import INITIAL_VERIFY_ESTIMATE_S, Estimates
from .report import DecodeLink, StatusReporter
from .room import TRANSFERRING, DecodeRoom, RoomState, Source
from .rooms import RoomTable
from .sessions import PrefillSessions
from .windowed import WindowedApplier

logger = logging.getLogger(__name__)


class DecodeApplier:
    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, endpoint: Endpoint, link: DecodeLink,
                 recorder: Recorder, waiting_timeout_s: float = 300.0, tp_ranks: int = 1):
        self.config = config
        self.link = link
        self.recorder = recorder
        self._wake = threading.Event()
        wake = self._wake.set
        self.rooms = RoomTable()
        # The rank keys SGLang's bootstrap lookups found (the receivers `record` them).
        self.bindings = RankBindings(link.lookup_prefill_rank)
        self.sessions = PrefillSessions(config, endpoint, self.bindings, wake)
        # How long a room's transfer may take from its announcement, queue at the prefill
        # included: SGLang's own budget for a decode request
        # (SGLANG_DISAGGREGATION_WAITING_TIMEOUT), as with its other backends. Once bytes land,
        # --lynx-transfer-timeout-s is a stall deadline (from the latest landed byte): a layer-
        # streamed transfer lasts as long as the prefill's forward, which may be long.
        self.admission = StagingAdmission(
            config, pool, staging, staging_region, self.sessions, self.rooms, recorder, wake,
            waiting_s=max(waiting_timeout_s, config.transfer_timeout_s))
        self.reporter = StatusReporter(config, self.rooms, link, recorder, self.admission.release,
                                       wake)
        self.estimates = Estimates(verify_s=INITIAL_VERIFY_ESTIMATE_S)
        # A layer's V is applied on it while the applier thread applies its K.
        self.apply_helper = (ThreadPoolExecutor(1, thread_name_prefix="lynx-apply-v")
                             if config.apply_threads > 1 else None)
        deps = ApplyDeps(config, pool, staging, self.rooms, link, self.reporter, self.apply_helper,
                         wake, tp_ranks)
        self.streams = StreamApplier(deps, self.estimates)
        self.windowed = WindowedApplier(deps, self.admission)
        endpoint.on_progress(wake)

    # ---- threads ------------------------------------------------------------------------------
    def accept_loop(self, stop: threading.Event) -> None:
        """The accept thread: `PrefillSessions.accept_loop`."""
        self.sessions.accept_loop(stop)

    def run(self, stop: threading.Event) -> None:
        """The applier thread's loop. A failure in one room fails that room only."""
        while not stop.is_set():
            # Cleared before looking, so a wake-up during the steps below is never lost.
            self._wake.clear()
            with self.rooms.lock:
                staged = self.admission.admit_queued()
                rooms = self.rooms.start_applying()
            for room in rooms:
                try:
                    # Not if it failed meanwhile with another part of its room
                    # (`StatusReporter.fail`).
                    if room.state in TRANSFERRING:
                        self._step(room)
                except Exception as exc:
                    logger.exception("lynx: applying room %s failed", room.room)
                    self.reporter.fail_safely(room, f"lynx decode failed: {exc}",
                                              failure_kind_of(exc))
                finally:
                    with self.rooms.lock:
                        self.rooms.done_applying(room)
            if staged:
                self.link.progress()  # their receivers may send the metadata now
            self._forget_dead_prefills()
            # The transport wakes this thread when bytes land (`Endpoint.on_progress`), SGLang's
            # calls when a room changes; the timeout only bounds the unannounced-room deadline.
            self._wake.wait(0.1)
        if self.apply_helper is not None:
            self.apply_helper.shutdown(wait=True)

    def _step(self, room: DecodeRoom) -> None:
        if room.state is RoomState.AWAITING_SESSION:
            self._announce_or_expire(room)
        elif room.segments is not None:
            self.windowed.step(room)
        else:
            self.streams.step(room)

    def _announce_or_expire(self, room: DecodeRoom) -> None:
        """A room waiting for its prefill rank's session: announce it once the session is up;
        fail it if the rank was refused, or once it waited past the waiting budget."""
        with self.rooms.lock:
            announced = self.admission.try_announce(room)
        if announced:
            return
        # The prefill opens its session at its first transfer, after that request's prefill
        # forward (behind its queue): the waiting budget applies, not the connect timeout.
        refused = self.sessions.refused(room.prefill)
        waiting_s = self.admission.waiting_s
        if refused is not None:
            self.reporter.fail(room, refused, FailureKind.SETTINGS_MISMATCH)
        elif time.monotonic() - room.waiting_since > waiting_s:
            self.link.forget_prefill_rank(room.prefill)
            self.reporter.fail(room, f"no transport session from prefill rank {room.prefill} "
                                     f"within {waiting_s:g} s", FailureKind.TIMEOUT)

    def _forget_dead_prefills(self) -> None:
        """A prefill rank whose session ended (it died, or stalled past the heartbeat) is
        forgotten even when none of its rooms was in flight here: a room failing is not the only
        sign. Otherwise, with SGLang's heartbeat slower than a restart (or off), the next request
        went to the dead rank's cached address and waited out every timeout (found by the fault
        matrix: prefill killed after its client had hung up)."""
        for rank in self.sessions.forget_dead():
            self.link.forget_prefill_rank(rank)

    # ---- SGLang's scheduler thread ------------------------------------------------------------
    def tracked(self) -> dict[str, int]:
        """`RoomTable.tracked`."""
        return self.rooms.tracked()

    def register(self, room_id: int, sources: list[Source], kv_indices,
                 aux_index: int, rid: str | None = None) -> bool:
        """A receiver is about to send the room's metadata to the prefill ranks its KV comes
        from (`sources`: one, or several when the prefill's attention TP size is larger; `rid`:
        SGLang's request id, for the records). Returns False if the room is queued for staging:
        the receiver must hold the metadata back until `staged` returns True. Raises
        `StagingFullError` for a room one layer of which exceeds the whole staging pool (of
        several sources: one source's part)."""
        return self.admission.register(room_id, sources, kv_indices, aux_index, rid)

    def staged(self, room_id: int) -> bool:
        """A queued room's receiver asks (scheduler thread, from its poll) whether the room holds
        its staging range now. Raises `StagingFullError` once it has waited past the waiting
        budget (the room is then gone here; the receiver fails the request)."""
        return self.admission.staged(room_id)

    def on_prefill_success(self, room_id: int) -> bool:
        """The prefill reported Success for the room. Returns True if that status must not
        reach SGLang now (the final KV is not in the pool yet, Success was already reported at
        Anchor time, or the room failed and its Failed is on its way: `StatusReporter.fail`);
        False to let it through (the room is done, or not Lynx's; SGLang keeps a Failed it has
        over it)."""
        return self.reporter.on_prefill_success(room_id)

    def drop(self, room_id: int, *, keep_speculative: bool = False) -> None:
        """The receiver is done with the room: free what it still holds. With `keep_speculative`
        (a clear after SGLang committed a room reported at Anchor time) the Residual transfer
        goes on for the speculation controller."""
        with self.rooms.lock:
            parts = self.rooms.parts_of(room_id)
            if keep_speculative and any(room.reported_at_anchor for room in parts):
                return  # a room of several sources never speculates: one part is the room
            for room in parts:
                self.rooms.pop(room.key)
                self.rooms.wait_idle(room)
                self._end(room)

    # ---- the speculation controller's interface -----------------------------------------------
    def residual_outcome(self, room_id: int) -> ResidualOutcome | None:
        """None if the room was not reported at Anchor time (or is forgotten)."""
        with self.rooms.lock:
            room = self.rooms.get(room_id)
            return room.outcome() if room is not None and room.reported_at_anchor else None

    def forget(self, room_id: int) -> None:
        """The controller consumed the room's APPLIED/FAILED outcome."""
        with self.rooms.lock:
            room = self.rooms.get(room_id)
            if room is not None and room.reported_at_anchor:
                self.rooms.pop(room_id)

    def cancel(self, room_id: int) -> bool:
        """The request's KV slots are being freed: stop its transfer so nothing is written into
        them any more. Returns True if a pending Residual was cancelled. A barrier: if the applier
        is writing this room's slots right now, this waits until it is done."""
        with self.rooms.lock:
            room = self.rooms.get(room_id)
            if room is None or not room.reported_at_anchor:
                return False
            self.rooms.pop(room_id)
            self.rooms.wait_idle(room)
            if not room.live:
                return False
            logger.info("lynx: room %s released before its Residual was applied; transfer "
                        "cancelled", room_id)
            self._end(room)
            return True

    def note_verification(self, seconds: float) -> None:
        """The speculation controller's measured cost of one verification."""
        self.estimates.note_verification(seconds)

    def waiting(self, room_id: int) -> None:
        """The controller parked the room's request: its tokens wait on the Residual now. Tell
        its prefill (the transport's WAITING, once; nothing once the Residual is in)."""
        with self.rooms.lock:
            room = self.rooms.get(room_id)
            session = room.session if room is not None and room.reported_at_anchor else None
        if session is not None:  # outside the table's lock: the session takes its own
            session.mark_waiting(room_id)

    def _end(self, room: DecodeRoom) -> None:
        """With the table's lock held: stop the room's transfer where it is and give back its
        resources."""
        if room.live:
            room.cancel()
            self.recorder.emit(room.trace)
        self.admission.release(room)
