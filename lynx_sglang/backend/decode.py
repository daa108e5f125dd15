"""The decode side of the `lynx` backend: `DecodeApplier` announces each request's staging range
to its prefill rank's transport session and puts the landed streams into the KV pool.

Per request ("room", a `backend.room.DecodeRoom`):
- `register` (SGLang's scheduler thread, from the receiver's `send_metadata`): the room's plan
  sizes its staging range (never waiting: a full staging buffer fails the request at once), and
  the range is announced as soon as the prefill rank's session exists.
- The applier thread (`run`): when the Anchor stream is complete it is parsed and dequantized into
  the room's KV slots (skipped if the Residual has landed too) and SGLang's aux data is written.
  Non-speculative: SGLang hears Success only once the Residual has refined the same slots (and the
  prefill's own Success arrived), so nothing in SGLang sees Anchor-precision KV. Speculative: Success
  is reported as soon as the Anchor is in, SGLang decodes on it, and the room stays here, after
  the receiver is cleared, until the speculation controller has read its Residual outcome
  (`residual_outcome`, `forget`).
- The accept thread (`accept_loop`): each prefill rank opens one transport session and announces
  its SGLang identity (rank ip:port) as the empty request `IDENTITY_REQUEST`.

Given by `backend.manager.LynxKVManager`: the pool view, the staging pool and its region, the
transport endpoint, the config, and `DecodeLink` (the one status report to SGLang, the aux writer,
and the bootstrap-cache eviction of a dead prefill rank). Locking: one lock guards the rooms and is
held while a room's bytes are applied, so `cancel` is a barrier: after it returns nothing is
written into the room's slots. Buffer ownership: a room's staging range is the applier's from
`register` until `_release`, which first withdraws the announcement (no byte lands after it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lynx_transport import Endpoint, FailureReason, Region, Session, Status, Stream, TransportError

from .. import metrics
from ..config import LynxConfig
from ..names import TRANSFER_RECORD, record_line
from .aux import unpack_aux
from .outcome import ResidualOutcome
from .plan import StreamPlan
from .pool import KVPoolView
from .prefill import IDENTITY_REQUEST
from .room import TRANSFERRING, DecodeRoom, RoomState
from .staging import StagingPool
from .streams import apply_residual, parse_anchor, write_anchor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeLink:
    """What the applier needs from SGLang's side of the manager (all thread-safe callables)."""

    # The one status report: (room, None for Success | the failure reason).
    report: Callable[[int, str | None], None]
    # Write SGLang's aux items [(buffer index, bytes)] into the room's aux slot `aux_index`.
    write_aux: Callable[[int, list[tuple[int, bytes]]], None]
    # A prefill rank (ip, port) died or never connected: forget SGLang's cached route to it.
    forget_prefill_rank: Callable[[tuple[str, int]], None]


class DecodeApplier:
    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, endpoint: Endpoint, link: DecodeLink):
        self.config = config
        self.spec = config.codec
        self._pool = pool
        self.staging = staging
        self.staging_region = staging_region
        self.endpoint = endpoint
        self.link = link
        self._prefill_sessions: dict[tuple[str, int], Session] = {}
        # Every room not yet forgotten: transferring, awaiting the prefill's Success, or reported
        # at Anchor time and not yet consumed by the speculation controller.
        self._rooms: dict[int, DecodeRoom] = {}
        self._lock = threading.RLock()
        self._wake = threading.Event()

    # ---- threads ------------------------------------------------------------------------------
    def accept_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            s = self.endpoint.accept(timeout=0.5)
            if s is None:
                continue
            try:
                ann = s.wait_announcement(IDENTITY_REQUEST, timeout=self.config.connect_timeout_s)
                who = json.loads(ann.meta)
                key = (who["rank_ip"], int(who["rank_port"]))
            except (TransportError, ValueError, KeyError) as exc:
                logger.error("lynx: session from %s without a valid identity: %s",
                             s.peer_address, exc)
                s.close()
                continue
            with self._lock:
                self._prefill_sessions[key] = s
            logger.info("lynx: transport session from prefill rank %s:%d", *key)
            self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """The applier thread's loop."""
        while not stop.is_set():
            with self._lock:
                rooms = [r for r in self._rooms.values() if r.state in TRANSFERRING]
            for room in rooms:
                with self._lock:
                    if room.state not in TRANSFERRING or self._rooms.get(room.room) is not room:
                        continue
                    try:
                        self._step(room)
                    except Exception as exc:
                        logger.exception("lynx: applying room %s failed", room.room)
                        self._fail(room, f"lynx decode failed: {exc}")
            self._wake.wait(0.002 if rooms else 0.1)
            self._wake.clear()

    # ---- SGLang's scheduler thread ------------------------------------------------------------
    def register(self, room_id: int, prefill: tuple[str, int], kv_indices,
                 aux_index: int) -> None:
        """A receiver is about to send the room's metadata to the prefill."""
        pool = self._pool()
        slots = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64), device=pool.device)
        plan = StreamPlan.build(self.spec, pool.shape, len(slots), self.config.chunk_tokens)
        # Never block the scheduler thread: a full staging buffer fails the request at once.
        staging = self.staging.allocate(plan.staging_bytes, timeout_s=0.0)
        room = DecodeRoom(room_id, prefill, slots, aux_index, plan, staging)
        with self._lock:
            self._rooms[room_id] = room
            self._try_announce(room)
        self._wake.set()

    def on_prefill_success(self, room_id: int) -> bool:
        """The prefill reported Success for the room. Returns True if that status must not
        reach SGLang now (the final KV is not in the pool yet, or Success was already reported at
        Anchor time); False to let it through (the room is done, or not Lynx's)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return False
            room.prefill_success = True
            if room.state is RoomState.AWAITING_PREFILL:
                room.done()
                del self._rooms[room_id]
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
            self._end(room)
            del self._rooms[room_id]

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
        them any more. Returns True if a pending Residual was cancelled. Holding the lock the
        applier holds while it writes makes this a barrier: no write happens after the return."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or not room.reported_at_anchor:
                return False
            del self._rooms[room_id]
            if not room.live:
                return False
            logger.info("lynx: room %s released before its Residual was applied; transfer "
                        "cancelled", room_id)
            self._end(room)
            return True

    # ---- the applier's work -------------------------------------------------------------------
    def _try_announce(self, room: DecodeRoom) -> bool:
        s = self._prefill_sessions.get(room.prefill)
        if s is None or s.closed:
            return False
        plan = room.plan
        rid = self.staging_region.id
        s.announce(room.room, {
            Stream.ANCHOR: [(rid, room.staging.offset, plan.anchor_bytes)],
            Stream.RESIDUAL: [(rid, room.staging.offset + plan.anchor_bytes,
                               plan.residual_bytes)]},
            deadline_s=self.config.transfer_timeout_s)
        room.announced(s)
        return True

    def _step(self, room: DecodeRoom) -> None:
        if room.state is RoomState.AWAITING_SESSION:
            # The prefill opens its session at its first transfer, after that request's prefill
            # forward: the whole transfer deadline applies, not the connect timeout.
            if (not self._try_announce(room)
                    and time.monotonic() - room.created > self.config.transfer_timeout_s):
                self.link.forget_prefill_rank(room.prefill)
                self._fail(room, f"no transport session from prefill rank {room.prefill} "
                                 f"within {self.config.transfer_timeout_s:g} s")
            return
        pool = self._pool()
        view = self.staging.view(room.staging)
        plan = room.plan
        if room.state is RoomState.ANNOUNCED:
            st = self._landed(room, Stream.ANCHOR)
            if st is None:
                return
            room.anchors = parse_anchor(view[:plan.anchor_bytes], pool, plan.num_tokens,
                                        self.spec, room.room)
            # When the Residual has landed too, go straight to full precision.
            residual_landed = room.session.recv_state(room.room, Stream.RESIDUAL).ok
            if not residual_landed:
                write_anchor(room.anchors, pool, room.slots)
                room.t_anchor_applied = time.monotonic()
            self.link.write_aux(room.aux_index, unpack_aux(st.aux or b""))
            _sync(pool)
            if not self.config.residual:
                # Anchor-only baseline: the Anchor is the final KV.
                room.final_kv(st.t_done, None)
                self._conclude(room)
                return
            if residual_landed:
                room.t_anchor_landed = st.t_done
            else:
                reported = self.config.speculate
                room.anchor_applied(st.t_done, reported=reported)
                if reported:
                    self.link.report(room.room, None)
        st = self._landed(room, Stream.RESIDUAL)
        if st is None:
            return
        apply_residual(view[plan.anchor_bytes: plan.staging_bytes], room.anchors, pool,
                       room.slots, self.spec, room.room)
        _sync(pool)
        if room.state is RoomState.SPECULATING:
            room.refined(st.t_done)
        else:
            room.final_kv(room.t_anchor_landed, st.t_done)
        self._conclude(room)

    def _landed(self, room: DecodeRoom, stream: Stream):
        """The stream's receive state once all its bytes have landed; None while it has not (or
        after failing the room because the stream failed)."""
        st = room.session.recv_state(room.room, stream)
        if st.status is Status.FAILED:
            name = "Anchor" if stream is Stream.ANCHOR else "Residual"
            if st.reason is FailureReason.PEER_DIED:
                self.link.forget_prefill_rank(room.prefill)
            self._fail(room, f"{name} stream failed: {st.reason.value} {st.detail}")
            return None
        return st if st.ok else None

    def _conclude(self, room: DecodeRoom) -> None:
        """The room's KV is final in the pool: record it, give back the transfer resources, and
        report Success unless that happened at Anchor time (or waits for the prefill's)."""
        self._record(room)
        self._release(room)
        if room.state is RoomState.AWAITING_PREFILL and room.prefill_success:
            room.done()
            del self._rooms[room.room]
            self.link.report(room.room, None)

    def _record(self, room: DecodeRoom) -> None:
        plan = room.plan
        residual_bytes = plan.residual_bytes if self.config.residual else 0
        now_mono, now_wall = time.monotonic(), time.time()
        wall = lambda t: None if t is None else round(now_wall - (now_mono - t), 6)  # noqa: E731
        logger.info("%s", record_line(TRANSFER_RECORD, {
            "room": room.room, "tokens": plan.num_tokens,
            "anchor_bytes": plan.anchor_bytes, "residual_bytes": residual_bytes,
            "announced": wall(room.created), "anchor_landed": wall(room.t_anchor_landed),
            "anchor_applied": wall(room.t_anchor_applied),
            "residual_landed": wall(room.t_residual_landed),
            "residual_applied": round(now_wall, 6) if self.config.residual else None}))
        metrics.record_transfer(
            plan.anchor_bytes, residual_bytes,
            None if room.t_anchor_applied is None else room.t_anchor_applied - room.created,
            None if room.t_anchor_landed is None or not self.config.residual
            else now_mono - room.t_anchor_landed)

    def _release(self, room: DecodeRoom) -> None:
        """Withdraw the announcement (no byte lands after this) and free the staging range."""
        if room.session is not None:
            try:
                room.session.release(room.room)
            except TransportError as exc:
                logger.debug("lynx: release of room %s: %s", room.room, exc)
            room.session = None
        if room.staging is not None:
            self.staging.free(room.staging)
            room.staging = None

    def _end(self, room: DecodeRoom) -> None:
        """Stop the room's transfer where it is and give back its resources."""
        if room.live:
            room.cancel()
        self._release(room)

    def _fail(self, room: DecodeRoom, reason: str) -> None:
        logger.error("lynx: room %s failed: %s", room.room, reason)
        room.fail(reason)
        self._release(room)
        if room.reported_at_anchor:
            # SGLang already has Success and no longer polls: the speculation controller aborts
            # the running request when it reads this outcome.
            return
        del self._rooms[room.room]
        self.link.report(room.room, reason)


def _sync(pool: KVPoolView) -> None:
    if pool.device.type == "cuda":
        torch.cuda.current_stream(pool.device).synchronize()

