"""The prefill's destination workers: one thread per decode address (`DestinationWorker`), which
sends the rooms bound there, one group at a time, so that a dead or slow decode (connect,
announcement and staging waits are bounded, but long) holds up only its own rooms.
`DestinationWorkers` starts them on demand (`dispatch`) and lets an idle one exit.

Per room, the worker opens the session (`backend.prefill.sessions`), checks the decode's
announcement against this prefill's `StreamPlan`, allocates the room's staging
(`backend.prefill.inflight`), has a room writer (`backend.prefill.writer`) encode and write both
streams, and reports the room to SGLang (`PrefillLink.report`): Success once everything still to
be sent is in staging, or its failure, which fails that room only. Everything a worker needs
comes in `WorkerDeps`, given by `backend.prefill.sender.PrefillSender`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from lynx_transport import TransportError

from ...errors import SettingsMismatchError
from ...failures import failure_kind_of
from ...recorder import Recorder
from ..pages import num_pages
from ..plan import StreamPlan, room_plans, windowed_plan
from ..pool import KVPoolView
from ..window import Segments
from .anchor_width import WidthChoice, choose_width
from .inflight import InFlight, InFlightStaging
from .job import Job, StreamedJobs
from .layer_stream import LayerGateError
from .link import Destination, PrefillLink, SentBytes
from .sessions import DecodeSessions
from .stream_policy import StreamPolicy
from .writer import RoomWriter, WindowedWriter, WriterDeps, check_announcement

logger = logging.getLogger(__name__)

_Writer = RoomWriter | WindowedWriter


@dataclass(frozen=True)
class WorkerDeps:
    """What every destination worker of a prefill shares."""

    writer: WriterDeps
    pool: Callable[[], KVPoolView]
    link: PrefillLink
    sessions: DecodeSessions
    # Layer-streamed rooms awaiting SGLang's hand-over: a room sent or failed is forgotten there.
    streamed: StreamedJobs
    sent: SentBytes
    # Set when the sender's dispatcher ends: every worker exits.
    stopping: threading.Event
    # The process's: each room's trace record, failed sends.
    recorder: Recorder
    # The sender's: rooms sent after their forward report their Anchor's delivery time to it.
    stream_policy: StreamPolicy


class DestinationWorker:
    """Sends the rooms bound for one decode address, one group at a time (`send_group`), in its
    own thread. Exits after `IDLE_EXIT_S` without work (if `retire` agrees)."""

    IDLE_EXIT_S = 60.0

    def __init__(self, deps: WorkerDeps, address: str,
                 retire: Callable[[DestinationWorker], bool]):
        self.deps = deps
        self.address = address
        self._retire = retire
        self.jobs: queue.Queue[list[Job]] = queue.Queue()
        self.inflight = InFlightStaging(deps.writer.staging, deps.writer.config, deps.recorder,
                                        deps.stream_policy)
        self.thread = threading.Thread(target=self._run, name=f"lynx-send-{address[-12:]}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        idle_since = time.monotonic()
        while not self.deps.stopping.is_set():
            try:
                group = self.jobs.get(timeout=0.05)
            except queue.Empty:
                group = None
            try:
                if group is not None:
                    idle_since = time.monotonic()
                    self.send_group(group)
                self.inflight.reap()
            except Exception:
                logger.exception("lynx: prefill sender error (continuing)")
            if (group is None and not self.inflight and self.jobs.empty()
                    and time.monotonic() - idle_since > self.IDLE_EXIT_S
                    and self._retire(self)):
                return

    def send_group(self, jobs: list[Job]) -> None:
        """Send a group of rooms: one, or the rooms of one forward bound for this decode
        (`PrefillSender.start_early`, `PrefillSender.batched`). A failure fails its own room
        only."""
        if len(jobs) == 1:
            self.send_job(jobs[0])
            return
        # One decode each: open every room, then send layer l of every room before layer l + 1
        # of any, so that each room's Anchor goes out as the forward writes it (one room after
        # another, the second's whole encode came after the forward); then end every room's
        # Anchor before any room's Residual (an exact one is encoded then).
        writers: list[tuple[_Writer, InFlight | None]] = []
        for job in jobs:
            job.trace.mark("dequeued")
            try:
                writers.append(self._open(job, job.destinations[0]))
            except Exception as exc:
                self._fail_room(job, exc)
        for layer in range(self.deps.pool().shape.num_layers):
            self._each(writers, lambda w, layer=layer: w.layer(layer))
        self._each(writers, lambda w: w.finish_anchor())
        self._each(writers, lambda w: w.finish_residual())
        for w, _ in writers:
            try:
                self._done(w.job, w.posted, w.job.destinations)
            except Exception as exc:
                self._fail_room(w.job, exc)
        for job in jobs:
            self.deps.streamed.forget(job)

    def _each(self, writers: list[tuple[_Writer, InFlight | None]],
              step: Callable[[_Writer], object]) -> None:
        """One step of every room of a group; a room whose step raises gives its staging and
        announcement back, fails, and leaves the group."""
        for w, f in list(writers):
            try:
                step(w)
            except Exception as exc:
                writers.remove((w, f))
                # A cleanup error must not escape: the rest of the group still has to be sent
                # and this room reported, or SGLang waits for them until its own abort.
                try:
                    self.inflight.undo(f)
                except Exception:
                    logger.exception("lynx: giving back room %s's staging", w.job.room)
                self._fail_room(w.job, exc)

    def send_job(self, job: Job) -> None:
        """Send one room (its failure fails that room only)."""
        job.trace.mark("dequeued")
        try:
            self._send(job)
        except Exception as exc:
            self._fail_room(job, exc)
        finally:
            self.deps.streamed.forget(job)

    def _fail_room(self, job: Job, exc: Exception) -> None:
        logger.error("lynx: sending room %s failed: %s", job.room, exc,
                     exc_info=not isinstance(exc, (TransportError, LayerGateError)))
        job.trace.facts["failure"] = str(exc)
        self.deps.recorder.metrics.record_failure(failure_kind_of(exc))
        self.deps.recorder.emit(job.trace)
        self.deps.link.report(job.room, f"lynx prefill send failed: {exc}", [])
        self.deps.streamed.forget(job)

    def _send(self, job: Job) -> None:
        sent = 0
        for dst in job.destinations:
            writer, f = self._open(job, dst)
            try:
                sent += writer.run()
            except Exception:
                self.inflight.undo(f)
                raise
        self._done(job, sent, job.destinations)

    def _open(self, job: Job, dst: Destination
              ) -> tuple[RoomWriter, InFlight] | tuple[WindowedWriter, None]:
        """Ready `job`'s streams to `dst`: the session, the decode's announcement (checked
        against this prefill's plan) and a staging range, held in `inflight` from here on; or,
        when the decode announced the room in segments, its `WindowedWriter`."""
        deps = self.deps
        config = deps.writer.config
        room, tr = job.room, job.trace
        if dst.refusal is not None:
            raise SettingsMismatchError(dst.refusal)
        pool = deps.pool() if dst.heads is None else deps.pool().heads(*dst.heads)
        num_tokens = len(job.slots)
        plans = room_plans(config, pool.shape, num_tokens)
        plan = plans[config.codec.anchor_bits]
        self._note_plan(tr, plan)
        if dst.num_pages != num_pages(num_tokens, pool.page_size):
            raise SettingsMismatchError(f"decode allocated {dst.num_pages} KV pages of "
                                        f"{pool.page_size} tokens for a request of {num_tokens} "
                                        "tokens")
        session = deps.sessions.open(dst.session_address)
        ann = session.wait_announcement(room, timeout=config.connect_timeout_s)
        tr.mark("announcement")
        segments = Segments.parse(ann.meta, plan.num_layers)
        if segments is not None:
            plan = windowed_plan(config, pool.shape, num_tokens)
            self._note_plan(tr, plan)
            tr.facts.update(segments=segments.count)
            return WindowedWriter(deps.writer, session, job, pool, plan, segments,
                                  self.inflight), None
        check_announcement(ann, plan)
        plan = plans[self._width(job, dst, plans).anchor_bits]
        self._note_plan(tr, plan)
        staging = self.inflight.allocate(plan.staging_bytes)
        f = InFlight(room, session, staging, tr, dst.session_address, job.ready_at)
        writer = RoomWriter(deps.writer, session, job, pool, staging, plan)
        self.inflight.add(f)
        return writer, f

    def _width(self, job: Job, dst: Destination, plans: dict[int, StreamPlan]) -> WidthChoice:
        """The room's Anchor width to `dst` (`backend.prefill.anchor_width`)."""
        policy = self.deps.stream_policy
        streamed = job.gate is not None
        tokens = job.forward_tokens if streamed else len(job.slots)
        choice = choose_width(tuple(sorted(plans)),
                              {w: p.anchor_bytes for w, p in plans.items()},
                              policy.link_s_per_byte(dst.session_address),
                              None if tokens is None else policy.forward_s(tokens), streamed)
        if len(plans) > 1:
            job.trace.facts["anchor_width"] = choice.why
            logger.debug("lynx: room %s to %s: %d Anchor bits (%s)", job.room,
                         dst.session_address, choice.anchor_bits, choice.why)
        return choice

    def _note_plan(self, tr, plan: StreamPlan) -> None:
        tr.facts.update(tokens=plan.num_tokens, anchor_bits=plan.anchor_bits,
                        anchor_bytes=plan.anchor_bytes,
                        residual_bytes=plan.residual_bytes if self.deps.writer.config.residual
                        else 0)

    def _done(self, job: Job, sent: int, destinations: list[Destination]) -> None:
        self.deps.sent.record(job.room, sent)
        self.deps.link.report(job.room, None, [d.notify for d in destinations])
        job.trace.mark("reported")


class DestinationWorkers:
    """The prefill's destination workers by decode address, started on demand. Thread-safe."""

    def __init__(self, deps: WorkerDeps):
        self.deps = deps
        self._workers: dict[str, DestinationWorker] = {}
        self._lock = threading.Lock()

    def dispatch(self, jobs: list[Job]) -> None:
        """Queue rooms bound for one decode address to its worker, as one group."""
        address = jobs[0].destinations[0].session_address
        with self._lock:
            worker = self._workers.get(address)
            if worker is None:
                worker = self._workers[address] = DestinationWorker(self.deps, address,
                                                                    self._retire)
            worker.jobs.put(jobs)

    def in_flight(self) -> int:
        """Rooms queued to a worker or holding its staging."""
        with self._lock:
            workers = list(self._workers.values())
        return sum(len(w.inflight) + w.jobs.qsize() for w in workers)

    def _retire(self, worker: DestinationWorker) -> bool:
        """An idle worker asks to exit; False if a job raced in."""
        with self._lock:
            if not worker.jobs.empty():
                return False
            self._workers.pop(worker.address, None)
            return True
