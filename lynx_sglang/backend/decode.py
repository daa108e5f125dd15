"""The decode side of the `lynx` backend: `DecodeApplier` announces each request's staging range
to its prefill rank's transport session and puts the landed streams into the KV pool, layer by
layer as the bytes land.

Per request ("room", a `backend.room.DecodeRoom`):
- `register` (SGLang's scheduler thread, from the receiver's `send_metadata`): the room's plan
  sizes its staging range, announced as soon as the prefill rank's session exists. It never
  waits: a room that finds no free range (or others queued before it) is queued, first come
  first served, and its receiver holds its metadata back until `staged` says the room got a
  range (so the prefill does not start it meanwhile); past the waiting budget it fails. A room
  larger than the whole staging pool is windowed (`backend.window`): it holds one or two
  windows, its segments of whole layers take turns in them (`_step_windowed`), and it never
  speculates; only a room one layer of which exceeds the pool fails at once.
- The applier thread (`run`) works on what has landed so far. Each Anchor layer is validated as
  soon as its bytes are in; when speculation is on it is also dequantized into the room's KV slots
  right away. Each Residual layer is validated and written at full precision as soon as its
  chunks are in. With `--lynx-apply-threads 2` a layer's V run is applied on a helper thread
  (`apply_helper`) while this thread applies its K run; the layer's call returns only when both
  have ended. When the whole Anchor is in, SGLang's aux data (the first token) is written and
  the applier decides whether speculating pays (`_speculation_pays`: the Residual's expected
  arrival, at the rate recent Residuals came in (`Estimates`), against what the rest of the
  Anchor and a verification cost). Speculative: Success is
  reported now, SGLang decodes on the Anchor, and the room stays here until the speculation
  controller has read its Residual outcome (`residual_outcome`, `forget`). Otherwise SGLang hears
  Success only once every layer is final (and the prefill's own Success arrived), so nothing in
  SGLang sees Anchor-precision KV.
- The accept thread (`accept_loop`): each prefill rank opens one transport session and announces
  its SGLang identity (rank ip:port) as the empty request `IDENTITY_REQUEST` (`backend.identity`,
  the handshake's both ends), answered accepted or refused. A rank already
  served by a live session is never silently taken over by another.

Given by `backend.manager.LynxKVManager`: the pool view, the staging pool and its region, the
transport endpoint, the config, and `DecodeLink` (the one status report to SGLang, the aux writer,
and the bootstrap-cache eviction of a dead prefill rank).

Locking: `_lock` guards the rooms, their states and the session map, and is never held while
bytes are applied. A room being applied is `busy`; `cancel` and `drop` wait for that room's work
to end before they return (a barrier: nothing is written into its slots afterwards), without ever
waiting for another room. Buffer ownership: a room's staging range is the applier's from `register`
until `_release`, which first withdraws the announcement (no byte lands after it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from lynx_transport import Endpoint, FailureReason, Region, Session, Status, Stream, TransportError

from .. import metrics, trace
from ..config import LynxConfig, wire_mismatch
from ..errors import KVStreamError, RoomDroppedError, StagingFullError
from ..failures import FailureKind, failure_kind_of, stream_failure_kind
from ..names import STAGING_QUEUED_LOG, TRANSFER_RECORD, WINDOWED_ROOM_LOG, record_line
from .aux import unpack_aux
from .identity import IDENTITY_REQUEST, Identity, answer
from .outcome import ResidualOutcome
from .plan import StreamPlan
from .pool import KVPoolView
from .room import TRANSFERRING, DecodeRoom, RoomState
from .staging import ALIGN as STAGING_ALIGN
from .staging import StagingPool
from .streams import ResidualReader, anchor_layer, apply_anchor_layer, apply_full_layer
from .window import SEGMENT_IDS
from .window import choose as choose_windows
from .window import cut as cut_segments

logger = logging.getLogger(__name__)

# How long cancel/drop wait for a room's in-progress apply before giving up loudly (an apply is
# bounded work: one step over already-landed bytes).
BUSY_WAIT_S = 30.0
# A prefill rank that connected but has not named itself within this long is dropped.
IDENTITY_TIMEOUT_S = 10.0
REFUSED_CLOSE_DELAY_S = 2.0
# What one verification is assumed to cost before the first one was measured (a GPU's order of
# magnitude; on a CPU the first measurement replaces it).
INITIAL_VERIFY_ESTIMATE_S = 0.05
# Residuals shorter than this say little about the rate of long ones (see `learn_residual_rate`).
LEARN_RESIDUAL_RATE_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class DecodeLink:
    """What the applier needs from SGLang's side of the manager (all thread-safe callables)."""

    # The one status report: (room, None for Success | the failure reason).
    report: Callable[[int, str | None], None]
    # Write SGLang's aux items [(buffer index, bytes)] into the room's aux slot `aux_index`.
    write_aux: Callable[[int, list[tuple[int, bytes]]], None]
    # A prefill rank (ip, port) died or never connected: forget SGLang's cached route to it.
    forget_prefill_rank: Callable[[tuple[str, int]], None]
    # A room reported at Anchor time reached its outcome (Residual applied, or failed): the
    # speculation controller has something to read, so wake a scheduler waiting in its idle path.
    progress: Callable[[], None]


class Estimates:
    """Running costs the speculation decision weighs (exponential moving averages)."""

    def __init__(self, verify_s: float):
        self.verify_s = verify_s
        self.anchor_layer_s: float | None = None
        # Bytes/s at which earlier Residuals came in after their Anchor was complete. The Anchor's
        # own rate underestimates the Residual's arrival when the prefill codes the Residual
        # slower than it sends (the exact target: measured 610 ms to land where the Anchor's rate
        # predicted 181 ms).
        self.residual_rate: float | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new

    def learn_residual_rate(self, nbytes: int, seconds: float) -> None:
        """A Residual's `nbytes` landed `seconds` after its Anchor was complete. Small ones are
        not learned from: their time is the fixed cost of a request (a 5-token warm-up's
        Residual would set the rate of the long prompt after it)."""
        if nbytes >= LEARN_RESIDUAL_RATE_MIN_BYTES and seconds > 0:
            self.residual_rate = self._ema(self.residual_rate, nbytes / seconds)

    def residual_eta(self, remaining: int, anchor_rate: float) -> tuple[float, str]:
        """Seconds until `remaining` Residual bytes are in, and what rate said so: that of recent
        Residuals, else (the first request) this request's Anchor's."""
        if self.residual_rate is not None:
            return remaining / self.residual_rate, "at recent Residuals' rate"
        return remaining / anchor_rate, "at this Anchor's rate"


class DecodeApplier:
    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, endpoint: Endpoint, link: DecodeLink,
                 waiting_timeout_s: float = 300.0):
        self.config = config
        # How long a room's transfer may take from its announcement, queue at the prefill
        # included: SGLang's own budget for a decode request
        # (SGLANG_DISAGGREGATION_WAITING_TIMEOUT), as with its other backends. Once bytes land,
        # --lynx-transfer-timeout-s is a stall deadline (from the latest landed byte): a layer-
        # streamed transfer lasts as long as the prefill's forward, which may be long.
        self.waiting_s = max(waiting_timeout_s, config.transfer_timeout_s)
        self.spec = config.codec
        self._pool = pool
        self.staging = staging
        self.staging_region = staging_region
        self.endpoint = endpoint
        self.link = link
        self._prefill_sessions: dict[tuple[str, int], Session] = {}
        # Prefill ranks whose wire settings differ from ours: their rooms fail at once, saying so.
        self._refused_ranks: dict[tuple[str, int], str] = {}
        self._closing: list[tuple[Session, float]] = []  # refused sessions (accept thread only)
        # Every room not yet forgotten: transferring, awaiting the prefill's Success, reported at
        # Anchor time and not yet consumed by the speculation controller, or failed and its
        # Failed not yet reported.
        self._rooms: dict[int, DecodeRoom] = {}
        # Rooms that found no staging range, in arrival order (ids of rooms dropped meanwhile are
        # skipped when they come up).
        self._staging_queue: deque[int] = deque()
        self._next_segment_id = SEGMENT_IDS.start  # ids of windowed rooms' segments 1..
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._wake = threading.Event()
        self.estimates = Estimates(verify_s=INITIAL_VERIFY_ESTIMATE_S)
        # A layer's V is applied on it while the applier thread applies its K.
        self.apply_helper = (ThreadPoolExecutor(1, thread_name_prefix="lynx-apply-v")
                             if config.apply_threads > 1 else None)
        endpoint.on_progress(self._wake.set)

    # ---- threads ------------------------------------------------------------------------------
    def accept_loop(self, stop: threading.Event) -> None:
        """Register each prefill rank's session by the identity it announces. Sessions are
        checked without blocking, so a silent or malformed peer never delays another."""
        waiting: list[tuple[Session, float]] = []
        while not stop.is_set():
            s = self.endpoint.accept(timeout=0.1 if waiting or self._closing else 0.5)
            due = [c for c in self._closing if c[1] <= time.monotonic()]
            for refused, _ in due:
                refused.close()
            self._closing = [c for c in self._closing if c not in due]
            if s is not None:
                waiting.append((s, time.monotonic() + IDENTITY_TIMEOUT_S))
            still = []
            for session, deadline in waiting:
                try:
                    done = self._identify(session, deadline)
                except Exception:
                    logger.exception("lynx: identifying the session from %s failed",
                                     session.peer_address)
                    done = True
                if not done:
                    still.append((session, deadline))
            waiting = still

    def _identify(self, s: Session, deadline: float) -> bool:
        """True once `s` is registered or refused (closed)."""
        if s.closed:
            return True
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
        differ = wire_mismatch(self.config.wire_settings(), who.settings)
        if differ:
            why = (f"prefill rank {key[0]}:{key[1]} runs other --lynx-* settings than this decode "
                   f"({'; '.join(differ)}): give both servers the same flags")
            if self._refused_ranks.get(key) != why:
                logger.error("lynx: %s; its session from %s is closed and its requests fail",
                             why, s.peer_address)
            with self._lock:
                self._refused_ranks[key] = why
            # Closed a little later, so the answer arrives before the connection drops (the
            # prefill closes it itself once it has read the answer).
            answer(s, why)
            self._closing.append((s, time.monotonic() + REFUSED_CLOSE_DELAY_S))
            self._wake.set()
            return True
        with self._lock:
            self._refused_ranks.pop(key, None)
            current = self._prefill_sessions.get(key)
            if current is not None and not current.closed and current is not s:
                taken = True
            else:
                taken = False
                self._prefill_sessions[key] = s
        if taken:
            logger.error("lynx: session from %s claims prefill rank %s:%d, which a live session "
                         "already serves; closed", s.peer_address, *key)
            s.close()
            return True
        answer(s, None)
        logger.info("lynx: transport session from prefill rank %s:%d", *key)
        self._wake.set()
        return True

    def run(self, stop: threading.Event) -> None:
        """The applier thread's loop. A failure in one room fails that room only."""
        while not stop.is_set():
            # Cleared before looking, so a wake-up during the steps below is never lost.
            self._wake.clear()
            with self._lock:
                staged = self._admit_queued()
                rooms = [r for r in self._rooms.values() if r.state in TRANSFERRING]
                for room in rooms:
                    room.busy = True
            for room in rooms:
                try:
                    self._step(room)
                except Exception as exc:
                    logger.exception("lynx: applying room %s failed", room.room)
                    self._fail_safely(room, f"lynx decode failed: {exc}", failure_kind_of(exc))
                finally:
                    with self._lock:
                        room.busy = False
                        self._idle.notify_all()
            if staged:
                self.link.progress()  # their receivers may send the metadata now
            self._forget_dead_prefills()
            # The transport wakes this thread when bytes land (`Endpoint.on_progress`), SGLang's
            # calls when a room changes; the timeout only bounds the unannounced-room deadline.
            self._wake.wait(0.1)
        if self.apply_helper is not None:
            self.apply_helper.shutdown(wait=True)

    def _forget_dead_prefills(self) -> None:
        """A prefill rank whose session ended (it died, or stalled past the heartbeat) is
        forgotten even when none of its rooms was in flight here: a room failing is not the only
        sign. Otherwise, with SGLang's heartbeat slower than a restart (or off), the next request
        went to the dead rank's cached address and waited out every timeout (found by the fault
        matrix: prefill killed after its client had hung up)."""
        with self._lock:
            dead = [key for key, s in self._prefill_sessions.items() if s.closed]
            for key in dead:
                del self._prefill_sessions[key]
        for key in dead:
            self.link.forget_prefill_rank(key)

    # ---- SGLang's scheduler thread ------------------------------------------------------------
    def tracked(self) -> dict[str, int]:
        """Rooms this applier still holds (0 on an idle decode; `lynx_tracked_requests`): all,
        those queued for staging, and those whose Anchor has part landed (`lynx-sglang faults`
        reads this one to know that its fault hits a request mid-Anchor)."""
        with self._lock:
            rooms = list(self._rooms.values())
        return {"decode_rooms": len(rooms),
                "decode_rooms_awaiting_staging": sum(
                    r.state is RoomState.AWAITING_STAGING for r in rooms),
                "decode_rooms_anchor_landing": sum(
                    r.state is RoomState.ANNOUNCED
                    and 0 < r.anchor_layers_landed < r.plan.num_layers for r in rooms)}

    def register(self, room_id: int, prefill: tuple[str, int], kv_indices,
                 aux_index: int, rid: str | None = None) -> bool:
        """A receiver is about to send the room's metadata to the prefill (`rid`: SGLang's
        request id, for the records). Returns False if the room is queued for staging: the
        receiver must hold the metadata back until `staged` returns True. Raises
        `StagingFullError` for a room larger than the whole staging pool."""
        pool = self._pool()
        slots = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64), device=pool.device)
        plan = StreamPlan.build(self.spec, pool.shape, len(slots), self.config.chunk_tokens)
        windows = None
        if not self.staging.holds(plan.staging_bytes):
            windows = choose_windows(plan, self.staging.nbytes, STAGING_ALIGN)
        need = windows.staging_bytes if windows else plan.staging_bytes
        with self._lock:
            self._admit_queued()
            # Never block the scheduler thread; never overtake a room queued before this one.
            staging = None if self._staging_queue else self.staging.try_allocate(need)
            room = DecodeRoom(room_id, prefill, slots, aux_index, plan, staging)
            if rid is not None:
                room.trace.facts["rid"] = rid
            room.residual_reader = ResidualReader(plan.num_layers, plan.num_tokens)
            if windows is not None:
                room.windows = windows
                room.segments = cut_segments(plan.num_layers, windows.layers_per_segment,
                                             self._next_segment_id)
                self._next_segment_id += room.segments.count - 1
                room.trace.facts.update(segments=room.segments.count, windows=windows.count)
                logger.info("lynx: room %s needs %d B of staging, " + WINDOWED_ROOM_LOG +
                            " (%d B): sent in %d segments of %d layers through %d windows of %d B",
                            room_id, plan.staging_bytes, self.staging.nbytes,
                            room.segments.count, windows.layers_per_segment, windows.count,
                            windows.nbytes)
            self._rooms[room_id] = room
            if staging is None:
                self._staging_queue.append(room_id)
                logger.info("lynx: room %s %s: needs %d B (%d B free, %d rooms queued before "
                            "it)", room_id, STAGING_QUEUED_LOG, need,
                            self.staging.free_bytes(), len(self._staging_queue) - 1)
                return False
            self._try_announce(room)
        self._wake.set()
        return True

    def staged(self, room_id: int) -> bool:
        """A queued room's receiver asks (scheduler thread, from its poll) whether the room holds
        its staging range now. Raises `StagingFullError` once it has waited past the waiting
        budget (the room is then gone here; the receiver fails the request)."""
        with self._lock:
            self._admit_queued()
            room = self._rooms.get(room_id)
            if room is None:
                raise RoomDroppedError(f"room {room_id} was dropped while it waited for staging")
            if room.state is not RoomState.AWAITING_STAGING:
                return True
            waited = time.monotonic() - room.waiting_since
            if waited <= self.waiting_s:
                return False
            del self._rooms[room_id]
            reason = (f"no {room.staging_need} B of staging came free within "
                      f"{self.waiting_s:g} s ({self.staging.free_bytes()} B free of "
                      f"{self.staging.nbytes} B; raise --lynx-staging-mib, or admit fewer "
                      "concurrent requests)")
            room.fail(reason)
        trace.emit(room.trace)
        raise StagingFullError(reason)

    def _admit_queued(self) -> int:
        """With `_lock` held: give the queued rooms, oldest first, the ranges that are free now
        and announce them; stops at the first that does not fit (no overtaking, so a long request
        is never starved by short ones). Returns how many got one."""
        admitted = 0
        while self._staging_queue:
            room = self._rooms.get(self._staging_queue[0])
            if room is None or room.state is not RoomState.AWAITING_STAGING:
                self._staging_queue.popleft()  # dropped or failed while queued
                continue
            staging = self.staging.try_allocate(room.staging_need)
            if staging is None:
                break
            self._staging_queue.popleft()
            room.staged(staging)
            logger.info("lynx: room %s got its staging after %.0f ms in the queue", room.room,
                        room.trace.facts["staging_wait_ms"])
            self._try_announce(room)
            admitted += 1
        if admitted:
            self._wake.set()
        return admitted

    def on_prefill_success(self, room_id: int) -> bool:
        """The prefill reported Success for the room. Returns True if that status must not
        reach SGLang now (the final KV is not in the pool yet, Success was already reported at
        Anchor time, or the room failed and its Failed is on its way: `_fail`); False to let it
        through (the room is done, or not Lynx's; SGLang keeps a Failed it has over it)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return False
            room.prefill_success = True
            if room.state is RoomState.AWAITING_PREFILL:
                room.done()
                del self._rooms[room_id]
                trace.emit(room.trace)
                return False
            self._wake.set()
            return True

    def drop(self, room_id: int, *, keep_speculative: bool = False) -> None:
        """The receiver is done with the room: free what it still holds. With `keep_speculative`
        (a clear after SGLang committed a room reported at Anchor time) the Residual transfer
        goes on for the speculation controller."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or (keep_speculative and room.reported_at_anchor):
                return
            del self._rooms[room_id]
            self._wait_idle(room)
            self._end(room)

    # ---- the speculation controller's interface -----------------------------------------------
    def residual_outcome(self, room_id: int) -> ResidualOutcome | None:
        """None if the room was not reported at Anchor time (or is forgotten)."""
        with self._lock:
            room = self._rooms.get(room_id)
            return room.outcome() if room is not None and room.reported_at_anchor else None

    def forget(self, room_id: int) -> None:
        """The controller consumed the room's APPLIED/FAILED outcome."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None and room.reported_at_anchor:
                del self._rooms[room_id]

    def cancel(self, room_id: int) -> bool:
        """The request's KV slots are being freed: stop its transfer so nothing is written into
        them any more. Returns True if a pending Residual was cancelled. A barrier: if the applier
        is writing this room's slots right now, this waits until it is done."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or not room.reported_at_anchor:
                return False
            del self._rooms[room_id]
            self._wait_idle(room)
            if not room.live:
                return False
            logger.info("lynx: room %s released before its Residual was applied; transfer "
                        "cancelled", room_id)
            self._end(room)
            return True

    def note_verification(self, seconds: float) -> None:
        """The speculation controller's measured cost of one verification."""
        est = self.estimates
        est.verify_s = est._ema(est.verify_s, seconds)

    def _wait_idle(self, room: DecodeRoom) -> None:
        """With `_lock` held: wait until the applier is not working on `room`."""
        if not self._idle.wait_for(lambda: not room.busy, timeout=BUSY_WAIT_S):
            logger.error("lynx: room %s still being applied after %g s; releasing it anyway",
                         room.room, BUSY_WAIT_S)

    # ---- the applier's work (applier thread; the room is busy) --------------------------------
    def _try_announce(self, room: DecodeRoom) -> bool:
        """With `_lock` held."""
        s = self._prefill_sessions.get(room.prefill)
        if s is None or s.closed:
            return False
        if room.segments is None:
            self._announce(s, room.room, room.plan, room.staging.offset)
        else:
            for _ in range(min(room.windows.count, room.segments.count)):
                self._announce_segment(s, room)
        room.announced(s)
        return True

    def _announce(self, s: Session, request_id: int, plan: StreamPlan, at: int,
                  meta: bytes = b"") -> None:
        """Both streams of `plan`, back to back from staging offset `at`."""
        rid = self.staging_region.id
        s.announce(request_id, {
            Stream.ANCHOR: [(rid, at, plan.anchor_bytes)],
            Stream.RESIDUAL: [(rid, at + plan.anchor_bytes, plan.residual_bytes)]},
            deadline_s=self.waiting_s, stall_deadline_s=self.config.transfer_timeout_s,
            meta=meta)

    def _announce_segment(self, s: Session, room: DecodeRoom) -> None:
        """Announce the room's next segment into its window (segment j takes window j mod the
        window count, which segment j - count has left)."""
        seg, j = room.segments, room.seg_announced
        at = room.staging.offset + (j % room.windows.count) * room.windows.nbytes
        self._announce(s, seg.request_id(room.room, j), seg.plan(room.plan, j), at,
                       seg.meta() if j == 0 else b"")
        room.seg_announced += 1

    def _step(self, room: DecodeRoom) -> None:
        if room.state is RoomState.AWAITING_SESSION:
            with self._lock:
                announced = self._try_announce(room)
            # The prefill opens its session at its first transfer, after that request's prefill
            # forward (behind its queue): the waiting budget applies, not the connect timeout.
            refused = self._refused_ranks.get(room.prefill)
            if not announced and refused is not None:
                self._fail(room, refused, FailureKind.SETTINGS_MISMATCH)
            elif not announced and time.monotonic() - room.waiting_since > self.waiting_s:
                self.link.forget_prefill_rank(room.prefill)
                self._fail(room, f"no transport session from prefill rank {room.prefill} "
                                 f"within {self.waiting_s:g} s", FailureKind.TIMEOUT)
            return
        if room.segments is not None:
            self._step_windowed(room)
            return
        anchor = self._state(room, Stream.ANCHOR)
        if anchor is None:
            return
        residual = self._state(room, Stream.RESIDUAL) if self.config.residual else None
        if self.config.residual and residual is None:
            return
        pool = self._pool()
        progressed = self._landed_anchor_layers(room, anchor)
        progressed |= self._write_final_layers(room, residual, pool)
        if room.state is RoomState.ANNOUNCED and room.speculating is not False:
            progressed |= self._write_anchor_layers(room, pool)
        if room.state is RoomState.ANNOUNCED and anchor.ok:
            self._anchor_complete(room, anchor, residual, pool)
        # Every layer may be in the pool before the stream's end reaches us (on tcp the bytes
        # can overtake the completion message). Concluding releases the announcement, and a
        # prefill whose finish of the Residual came after that found no live announcement and
        # failed a request whose KV was complete (seen at 64 concurrent requests): wait for it.
        if room.final_layers == room.plan.num_layers and (residual is None or residual.ok) \
                and room.state in (RoomState.SPECULATING, RoomState.AWAITING_RESIDUAL):
            _sync(pool)
            if room.state is RoomState.SPECULATING:
                room.refined()
            else:
                room.final_kv()
            self._conclude(room)
        if progressed:
            self._wake.set()  # more may have landed meanwhile

    def _step_windowed(self, room: DecodeRoom) -> None:
        """A windowed room: once both streams of its oldest announced segment are complete,
        validate and write its layers at full precision, release it, and announce the next
        segment into the freed window; after the last one, conclude (never speculative)."""
        seg, j = room.segments, room.seg_applied
        request_id = seg.request_id(room.room, j)
        anchor = self._state(room, Stream.ANCHOR, request_id)
        if anchor is None:
            return
        if j == 0 and "anchor_first_byte" not in room.trace.marks:
            room.trace.mark_mono("anchor_first_byte", anchor.t_first_byte)
        residual = None
        if self.config.residual:
            residual = self._state(room, Stream.RESIDUAL, request_id)
            if residual is None:
                return
        if not anchor.ok or (residual is not None and not residual.ok):
            return
        plan = seg.plan(room.plan, j)
        at = (j % room.windows.count) * room.windows.nbytes
        view = self.staging.view(room.staging)[at: at + plan.staging_bytes]
        layers = seg.layers(j)
        pool = self._pool()
        if residual is None:
            for i, layer in enumerate(layers):
                apply_anchor_layer(anchor_layer(view, plan, i), pool, layer, room.slots,
                                   self.spec, room.room, self.apply_helper)
        else:
            landed = _landed(residual, plan.residual_bytes)
            reader = ResidualReader(len(layers), plan.num_tokens, first_layer=layers.start)
            ready = reader.advance(view[plan.anchor_bytes:], landed)
            if not reader.done or reader.pos != landed:
                raise KVStreamError(f"segment {j} (layers {layers.start}-{layers.stop - 1}): its "
                                    f"Residual of {landed} B does not hold exactly its layers")
            if j == 0:
                room.trace.mark_mono("residual_first_byte", residual.t_first_byte)
            t0 = time.time()
            room.trace.marks.setdefault("residual_apply_start", t0)
            for layer, chunks in ready:
                apply_full_layer(anchor_layer(view, plan, layer - layers.start), chunks, pool,
                                 layer, room.slots, self.spec, room.room, self.apply_helper)
            room.trace.span("residual_apply", layers.start, t0, time.time())
            room.seg_residual_bytes += reader.pos
        room.final_layers += len(layers)
        if j + 1 < seg.count:
            _sync(pool)
            _release_request(room, request_id)
            room.seg_applied += 1
            if room.seg_announced < seg.count:
                self._announce_segment(room.session, room)
            self._wake.set()  # the next segment may be in already
            return
        # The last segment (released with the room): its Anchor's end carries SGLang's aux
        # data (the first token).
        _sync(pool)
        room.trace.mark_mono("anchor_landed", anchor.t_done)
        if residual is not None:
            room.trace.mark_mono("residual_landed", residual.t_done)
        self.link.write_aux(room.aux_index, unpack_aux(anchor.aux or b""))
        room.trace.facts.update(speculate=False, why=(
            f"windowed: {seg.count} segments through {room.windows.count} windows"))
        if residual is None:
            room.trace.mark("anchor_applied")
            room.final_kv(anchor_only=True)
        else:
            with self._lock:
                room.anchor_complete(anchor.t_done, reported=False)
            room.final_kv()
        self._conclude(room)

    def _state(self, room: DecodeRoom, stream: Stream, request_id: int | None = None):
        """The stream's receive state (of the room, or of one of its segments), or None after
        failing the room because it failed."""
        st = room.session.recv_state(room.room if request_id is None else request_id, stream)
        if st.status is Status.FAILED:
            name = "Anchor" if stream is Stream.ANCHOR else "Residual"
            if st.reason is FailureReason.PEER_DIED:
                self.link.forget_prefill_rank(room.prefill)
            self._fail(room, f"{name} stream failed: {st.reason.value} {st.detail}",
                       stream_failure_kind(st.reason))
            return None
        return st

    def _landed_anchor_layers(self, room: DecodeRoom, st) -> bool:
        plan = room.plan
        landed = _landed(st, plan.anchor_bytes)
        if room.anchor_layers_landed == 0 and landed:
            room.trace.mark_mono("anchor_first_byte", st.t_first_byte)
        view = self.staging.view(room.staging)
        start = room.anchor_layers_landed
        while (room.anchor_layers_landed < plan.num_layers
               and plan.anchor_offset(room.anchor_layers_landed + 1) <= landed):
            layer = room.anchor_layers_landed
            room.anchor_layers[layer] = anchor_layer(view, plan, layer)
            room.anchor_layers_landed += 1
        return room.anchor_layers_landed > start

    def _write_anchor_layers(self, room: DecodeRoom, pool: KVPoolView) -> bool:
        """Dequantize the parsed Anchor layers that are not final yet into the pool."""
        if not (self.config.speculate or not self.config.residual):
            return False  # nothing would read Anchor-precision KV before the Residual's
        wrote = False
        for layer in range(room.anchor_written, room.anchor_layers_landed):
            if layer >= room.final_layers:
                t0 = time.time()
                if room.trace.marks.get("anchor_apply_start") is None:
                    room.trace.mark("anchor_apply_start", t0)
                apply_anchor_layer(room.anchor_layers[layer], pool, layer, room.slots, self.spec,
                                   room.room, self.apply_helper)
                t1 = time.time()
                room.trace.span("anchor_apply", layer, t0, t1)
                est = self.estimates
                est.anchor_layer_s = est._ema(est.anchor_layer_s, t1 - t0)
                wrote = True
        room.anchor_written = room.anchor_layers_landed
        return wrote

    def _write_final_layers(self, room: DecodeRoom, st, pool: KVPoolView) -> bool:
        """Write the full-precision values of every layer whose Residual is complete (and whose
        Anchor has been parsed)."""
        if st is None:
            return False
        reader = room.residual_reader
        view = self.staging.view(room.staging)[room.plan.anchor_bytes:]
        landed = _landed(st, len(view))
        if landed and "residual_first_byte" not in room.trace.marks:
            room.trace.mark_mono("residual_first_byte", st.t_first_byte)
        room.residual_ready.extend(reader.advance(view, landed))
        wrote = False
        while room.residual_ready and room.residual_ready[0][0] < room.anchor_layers_landed:
            layer, chunks = room.residual_ready.pop(0)
            t0 = time.time()
            if room.trace.marks.get("residual_apply_start") is None:
                room.trace.mark("residual_apply_start", t0)
            apply_full_layer(room.anchor_layers[layer], chunks, pool, layer, room.slots,
                             self.spec, room.room, self.apply_helper)
            room.trace.span("residual_apply", layer, t0, time.time())
            room.anchor_layers[layer] = None  # its memory views are no longer needed
            room.final_layers += 1
            wrote = True
        if reader.done and "residual_landed" not in room.trace.marks:
            # Every layer's bytes are in; on tcp that can be seen before the stream's completion
            # message, and the room may conclude before it: mark the landing now.
            landed_at = st.t_done if st.ok else time.monotonic()
            room.trace.mark_mono("residual_landed", landed_at)
            if room.t_anchor_landed is not None and room.residual_at_anchor is not None:
                self.estimates.learn_residual_rate(reader.pos - room.residual_at_anchor,
                                                   landed_at - room.t_anchor_landed)
        if st.ok and reader.done and reader.pos != landed:
            raise KVStreamError(f"the Residual stream has {landed - reader.pos} B after its "
                                "last layer")
        if st.ok and not reader.done:
            raise KVStreamError(f"the Residual stream ended after {reader.pos} B with layer "
                                f"{reader.next_layer} incomplete")
        return wrote

    def _anchor_complete(self, room: DecodeRoom, st, residual, pool: KVPoolView) -> None:
        """The whole Anchor is in the pool (or validated): write SGLang's aux data and decide
        whether SGLang decodes on it now."""
        room.trace.mark_mono("anchor_landed", st.t_done)
        self.link.write_aux(room.aux_index, unpack_aux(st.aux or b""))
        if not self.config.residual:
            # Anchor-only baseline: the Anchor is the final KV.
            self._write_anchor_layers(room, pool)
            _sync(pool)
            room.trace.mark("anchor_applied")
            room.final_kv(anchor_only=True)
            self._conclude(room)
            return
        room.residual_at_anchor = residual.nbytes
        pays, why = self._speculation_pays(room, st, residual)
        room.speculating = pays
        room.trace.facts.update(speculate=pays, why=why)
        if pays:
            self._write_anchor_layers(room, pool)
            _sync(pool)
            room.trace.mark("anchor_applied")
        with self._lock:
            room.anchor_complete(st.t_done, reported=pays)
        if pays:
            self.link.report(room.room, None)
            room.trace.mark("reported")

    def _speculation_pays(self, room: DecodeRoom, anchor, residual) -> tuple[bool, str]:
        """Whether decoding on the Anchor now beats waiting for the Residual: the Residual's
        expected arrival (its bytes still to come at the rate the Anchor came in) against what
        speculating costs first (the Anchor layers still to write, one verification)."""
        if not self.config.speculate:
            return False, "--no-lynx-speculate"
        if room.final_layers == room.plan.num_layers or (residual is not None and residual.ok):
            return False, "the Residual is already in"
        if self.config.spec_policy == "always":
            return True, "--lynx-spec-policy always"
        if anchor.t_first_byte is None or anchor.t_done is None:
            return True, "no rate measured"
        seconds = max(anchor.t_done - anchor.t_first_byte, 1e-6)
        remaining = max(room.plan.residual_bytes_expected - residual.nbytes, 0)
        est = self.estimates
        eta, basis = est.residual_eta(remaining, room.plan.anchor_bytes / seconds)
        layers_left = room.plan.num_layers - max(room.anchor_written, room.final_layers)
        cost = layers_left * (est.anchor_layer_s or 0.0) + est.verify_s
        facts = room.trace.facts
        facts.update(residual_eta_s=round(eta, 6), speculation_cost_s=round(cost, 6))
        if eta <= cost:
            return False, (f"the Residual is due in {eta * 1e3:.0f} ms ({basis}), sooner than "
                           f"speculating would pay back ({cost * 1e3:.0f} ms)")
        return True, f"the Residual is due in {eta * 1e3:.0f} ms ({basis})"

    def _conclude(self, room: DecodeRoom) -> None:
        """The room's KV is final in the pool: record it, give back the transfer resources, and
        report Success unless that happened at Anchor time (or waits for the prefill's)."""
        room.trace.mark("residual_applied" if self.config.residual else "anchor_applied")
        self._record(room)
        self._release(room)
        report = False
        with self._lock:
            if room.state is RoomState.AWAITING_PREFILL and room.prefill_success:
                room.done()
                self._rooms.pop(room.room, None)
                report = True
        if room.state is RoomState.REFINED or report:
            trace.emit(room.trace)
        if report:
            self.link.report(room.room, None)
        elif room.reported_at_anchor:
            self.link.progress()

    def _record(self, room: DecodeRoom) -> None:
        plan = room.plan
        residual_bytes = room.residual_bytes if self.config.residual else 0
        room.trace.facts["residual_bytes"] = residual_bytes
        marks = room.trace.marks

        def ms(start: str, end: str) -> float | None:
            if marks.get(start) is None or marks.get(end) is None:
                return None
            return round((marks[end] - marks[start]) * 1e3, 3)

        logger.info("%s", record_line(TRANSFER_RECORD, {
            "room": room.room, "rid": room.trace.facts.get("rid"), "tokens": plan.num_tokens,
            "anchor_bytes": plan.anchor_bytes, "residual_bytes": residual_bytes,
            "announced": marks.get("announced"), "anchor_landed": marks.get("anchor_landed"),
            "anchor_applied": marks.get("anchor_applied"),
            "residual_landed": marks.get("residual_landed"),
            "residual_applied": marks.get("residual_applied"),
            "speculate": room.trace.facts.get("speculate"),
            # Durations: the Anchor's and the Residual's time on the wire (first byte to last),
            # applying each after it landed, and the whole transfer from the announcement.
            "anchor_wire_ms": ms("anchor_first_byte", "anchor_landed"),
            "anchor_apply_ms": ms("anchor_landed", "anchor_applied"),
            "residual_wire_ms": ms("residual_first_byte", "residual_landed"),
            "residual_apply_ms": ms("residual_landed", "residual_applied"),
            "total_ms": ms("announced", "residual_applied" if self.config.residual
                           else "anchor_applied")}))
        anchor_applied = marks.get("anchor_applied")
        anchor_landed = marks.get("anchor_landed")
        metrics.record_transfer(
            plan.anchor_bytes, residual_bytes,
            None if anchor_applied is None else anchor_applied - marks["registered"],
            None if anchor_landed is None or not self.config.residual
            else marks["residual_applied"] - anchor_landed)

    def _release(self, room: DecodeRoom) -> None:
        """Withdraw the announcement (no byte lands after this) and free the staging range."""
        if room.session is not None:
            for request_id in room.segment_ids():
                _release_request(room, request_id)
            room.session = None
        if room.staging is not None:
            self.staging.free(room.staging)
            room.staging = None
            if self._staging_queue:
                self._wake.set()  # the applier gives the range to the oldest queued room
        room.anchor_layers = []
        room.residual_ready = []

    def _end(self, room: DecodeRoom) -> None:
        """Stop the room's transfer where it is and give back its resources."""
        if room.live:
            room.cancel()
            trace.emit(room.trace)
        self._release(room)

    def _fail_safely(self, room: DecodeRoom, reason: str, kind: FailureKind) -> None:
        """`_fail` from the applier's catch-all: whatever goes wrong there too is logged, and
        the thread that serves every other request goes on."""
        try:
            if room.live:
                self._fail(room, reason, kind)
        except Exception:
            logger.exception("lynx: failing room %s failed", room.room)

    def _fail(self, room: DecodeRoom, reason: str, kind: FailureKind) -> None:
        logger.error("lynx: room %s failed (%s): %s", room.room, kind.value, reason)
        metrics.record_failure(kind)
        with self._lock:
            room.fail(reason)
            reported = room.reported_at_anchor
        self._release(room)
        trace.emit(room.trace)
        if reported:
            # SGLang already has Success and no longer polls: the speculation controller aborts
            # the running request when it reads this outcome.
            self.link.progress()
            return
        # Failed reaches SGLang before the room is forgotten: until then a prefill Success finds
        # the failed room and is held back (`on_prefill_success`), afterwards it finds SGLang's
        # Failed, which SGLang never lets a later Success replace. Forgotten first, a Success in
        # between reached SGLang first and its receiver's poll kept it (issue 42: 1 room in 60).
        try:
            self.link.report(room.room, reason)
        finally:
            with self._lock:
                if self._rooms.get(room.room) is room:  # not dropped by its receiver meanwhile
                    del self._rooms[room.room]


def _release_request(room: DecodeRoom, request_id: int) -> None:
    """Withdraw one of the room's announcements (the room's, or one segment's)."""
    try:
        room.session.release(request_id)
    except TransportError as exc:
        logger.debug("lynx: release of room %s (request %s): %s", room.room, request_id, exc)


def _landed(st, bound: int) -> int:
    """Bytes of a stream that are in: a prefix, as each stream lands in order on tcp; backends that
    cannot tell (RDMA writes) report the total once the stream is complete."""
    return min(st.nbytes, bound)


def _sync(pool: KVPoolView) -> None:
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()
