"""The prefill side of the `lynx` backend: `PrefillSender` takes each request's KV slots from
SGLang and hands the complete room to the worker of its decode, which encodes its KV into staging
and writes the two streams to that decode.

Per request ("room"):
1. SGLang queues the request's KV slots chunk by chunk (`submit`); the dispatcher thread (`run`)
   collects them, and at the last chunk (quantization groups and protected tokens span the full
   token range) hands the room (a `backend.prefill.job.Job`) to the worker thread of its decode
   (`backend.prefill.worker`, one per decode address): a dead or slow decode delays only its own
   rooms, and after a failed connect its rooms fail at once for a while
   (`backend.prefill.sessions`).
2. The worker: the room's plan (`backend.plan.StreamPlan`) must match the decode's announcement
   (sizes of both streams; a mismatch means the two servers' `--lynx-*` flags or models differ);
   a staging range is allocated (`backend.prefill.inflight`); its room writer
   (`backend.prefill.writer`) encodes each layer's Anchor straight into staging and writes it at
   once; after the whole Anchor (finished with SGLang's aux data: first token etc.), each
   layer's Residual. Then Success is reported: SGLang may free the room's KV slots, since
   staging holds everything still to be sent.
   Layer streaming (`start_early`, `backend.prefill.layer_stream`): the rooms of one forward go to their
   decode's worker as soon as the forward starts, as one group, and each layer is sent for every
   room of the group as the forward writes it (`DestinationWorker.send_group`); SGLang hands
   each room over after the forward (`submit` of its last chunk).
3. The staging range lives until the transport has delivered both streams.

Given by `backend.manager.LynxKVManager`: the pool view, the staging pool and its region, the
transport endpoint, this prefill's identity with its rank key (`backend.rank_key.Claimant`),
`PrefillLink` (what the sender asks SGLang's side: is the room still live, where does it go,
its aux bytes; and the one status report), the process's recorder (each room's trace record,
failed sends), and the fault-injection plan of tests (`backend.prefill.faults`). Buffer ownership:
SGLang's KV slots are read until the room is reported; its staging range belongs to its worker
(`backend.prefill.inflight`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from lynx_kernels import StreamKind
from lynx_transport import Endpoint, Region

from ... import trace
from ...config import LynxConfig
from ...recorder import Recorder
from ..pages import num_pages
from ..plan import StreamPlan
from ..pool import KVPoolView
from ..rank_key import Claimant
from ..staging import StagingPool
from .faults import FaultPlan
from .job import Job, KeptRows, StreamedJobs
from .layer_stream import LayerGate
from .link import Destination, PrefillLink, SentBytes
from .sessions import DecodeSessions
from .stream_policy import StreamPolicy
from .worker import DestinationWorkers, WorkerDeps
from .writer import WriterDeps

logger = logging.getLogger(__name__)


@dataclass
class _Chunk:
    room: int
    kv_indices: np.ndarray
    is_last: bool
    aux_index: int | None
    wait_event: object | None
    submitted: float
    trace_ctx: object | None = None  # SGLang's TraceReqContext of the request, if tracing


class PrefillSender:
    """Intake and hand-over (see the module): SGLang's scheduler thread calls `submit`,
    `batched`, `start_early` and `take_sent_bytes`; the dispatcher thread runs `run`."""

    def __init__(self, config: LynxConfig, pool: Callable[[], KVPoolView], staging: StagingPool,
                 staging_region: Region, endpoint: Endpoint, claimant: Claimant,
                 link: PrefillLink, recorder: Recorder, faults: FaultPlan | None = None):
        self.config = config
        self._pool = pool
        self.link = link
        # The tests' holds; the dispatcher ends them when it stops.
        self.faults = faults or FaultPlan()
        self.sessions = DecodeSessions(endpoint, claimant, config)
        self._queue: queue.Queue[list[_Chunk]] = queue.Queue()
        # Chunks submitted inside `batched` (scheduler thread only), queued together at its end.
        self._held: list[_Chunk] | None = None
        self._pending: dict[int, list[np.ndarray]] = {}
        self._streamed = StreamedJobs()
        self._sent = SentBytes()
        self.stream_policy = StreamPolicy(config.layer_stream_min_share)
        self.stopping = threading.Event()
        # Shared by every destination worker: a layer's V is encoded while its K is.
        self.encoder = (ThreadPoolExecutor(1, thread_name_prefix="lynx-encode")
                        if config.encode_threads > 1 else None)
        self._workers = DestinationWorkers(WorkerDeps(
            WriterDeps(config, staging, staging_region, self.encoder, link.is_live,
                       link.read_aux, self.faults),
            pool, link, self.sessions, self._streamed, self._sent, self.stopping, recorder,
            self.stream_policy))

    def tracked(self) -> dict[str, int]:
        """Rooms this sender still holds (0 on an idle prefill; `lynx_tracked_requests`)."""
        return {"prefill_pending_chunks": len(self._pending),
                "prefill_rooms_streaming": len(self._streamed),
                "prefill_rooms_in_flight": self._workers.in_flight()}

    def start_early(self, rooms: list[tuple[int, np.ndarray]], gate: LayerGate,
                    forward_tokens: int | None = None) -> set[int]:
        """SGLang's scheduler thread, as a forward that computes the whole prompt of each
        (room, slots) in `rooms` starts: queue those rooms now, each Anchor layer to be sent once
        `gate` has it. Returns the rooms queued; the others go the usual way after the forward.
        A room is queued only if it goes to exactly one decode, known now, that allocated the
        pages these slots fill (`backend.pages`). The rooms bound for one decode go to its worker
        as one group, which it sends layer by layer across the group
        (`DestinationWorker.send_group`): every room's first layers go out while the forward
        computes, not one room after another's whole transfer. With `forward_tokens` (the
        forward's prompt tokens; CPU pools) a room is queued only where `stream_policy` finds
        that streaming pays."""
        jobs: list[Job] = []
        for room, slots in rooms:
            destinations = self.link.destinations(room) if self.link.is_live(room) else []
            if (len(destinations) != 1 or destinations[0].num_pages
                    != num_pages(len(slots), self._pool().page_size)):
                continue
            if forward_tokens is not None and not self._streams(destinations[0], len(slots),
                                                                forward_tokens):
                continue
            tr = trace.Trace("prefill", room)
            tr.facts["layer_streamed"] = True
            job = Job(room, slots, None, destinations, tr, gate=gate,
                      forward_tokens=forward_tokens)
            if not self._streamed.add(job):
                continue
            jobs.append(job)
        for group in _by_decode(jobs):
            for job in group:
                job.trace.facts["streamed_with_rooms"] = len(group)
            self._workers.dispatch(group)
        return {job.room for job in jobs}

    def _streams(self, dst: Destination, tokens: int, forward_tokens: int) -> bool:
        """Whether a room of `tokens` to `dst` is layer-streamed (`stream_policy`); a change of
        the answer for a decode is logged."""
        plan = StreamPlan.build(self.config.codec, self._pool().shape, tokens,
                                self.config.chunk_tokens)
        decision = self.stream_policy.decide(dst.session_address, plan.anchor_bytes,
                                             forward_tokens)
        if decision.changed:
            logger.info("lynx: layer streaming to %s: %s (%s)", dst.session_address,
                        "on" if decision.stream else "off, Anchors after the forward",
                        decision.why)
        return decision.stream

    def submit(self, room: int, kv_indices, is_last: bool, aux_index: int | None,
               wait_event=None, trace_ctx=None) -> None:
        """Queue one chunk of a room's KV slots (SGLang's scheduler thread; waits at most for
        one layer's encode of a layer-streamed room, see `_reconcile_streamed`)."""
        if isinstance(kv_indices, torch.Tensor):
            kv_indices = kv_indices.cpu().numpy()
        kv_indices = np.array(kv_indices, dtype=np.int64)
        if is_last:
            self._reconcile_streamed(room, kv_indices)
        chunk = _Chunk(room, kv_indices, is_last, aux_index, wait_event, time.time(), trace_ctx)
        if self._held is not None:
            self._held.append(chunk)
        else:
            self._queue.put([chunk])

    @contextmanager
    def batched(self) -> Iterator[None]:
        """SGLang's scheduler thread, around its handling of one forward's results: the chunks
        `submit`ted inside reach the dispatcher together, so the rooms they complete that go to
        one decode reach its worker as one group (`DestinationWorker.send_group`: every room's
        Anchor before any Residual) instead of one after another's whole transfer."""
        if self._held is not None:  # nested: the outer one sends them
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._queue.put(held)

    def _reconcile_streamed(self, room: int, tail: np.ndarray) -> None:
        """A layer-streamed room's last chunk, on the scheduler thread, before any slot SGLang
        freed since the forward can be written again. SGLang's prefix cache may have replaced
        slots the forward wrote by cached ones holding the same tokens (seen: a fully cached
        prompt whose last token is computed again; two requests computing the same tokens at
        once) and freed the forward's. The room goes on with the cached slots; where they hold
        other bits in any layer, the forward's rows there are copied first (`KeptRows`), so the
        room is sent as its forward computed it and the Anchor already sent stays right."""
        job = self._streamed.get(room)
        if job is None or len(tail) > len(job.slots):
            return
        start = len(job.slots) - len(tail)
        old = job.slots[start:]
        differ = np.nonzero(old != tail)[0]
        if not len(differ):
            return
        pool = self._pool()
        was = torch.as_tensor(old[differ], device=pool.device)
        now = torch.as_tensor(tail[differ], device=pool.device)
        layers = range(pool.shape.num_layers)
        with job.lock:
            same = all(torch.equal(pool.read(layer, kind, was), pool.read(layer, kind, now))
                       for layer in layers for kind in pool.kinds)
            if not same:
                job.kept = KeptRows(
                    torch.as_tensor(start + differ, device=pool.device),
                    [pool.read(layer, StreamKind.K, was) for layer in layers],
                    [pool.read(layer, StreamKind.V, was) for layer in layers
                     if StreamKind.V in pool.kinds],
                    torch.arange(len(job.slots), device=pool.device))
                if torch.device(pool.device).type == "cuda":
                    # The copies are queued on this (the scheduler's) stream, and the worker
                    # reads them on its own once it has the lock: they must be done by then.
                    torch.cuda.current_stream(pool.device).synchronize()
            slots = job.slots.copy()
            slots[start:] = tail
            job.slots = slots
        if same:
            logger.debug("lynx: room %s: %d slots replaced by the prefix cache's (same KV)",
                         room, len(differ))
        else:
            logger.info("lynx: room %s: SGLang's prefix cache replaced %d of the slots its "
                        "forward wrote by cached ones holding other bits; sending the "
                        "forward's own KV there (%.1f MiB kept)", room, len(differ),
                        job.kept.nbytes / 2**20)

    def take_sent_bytes(self, room: int) -> int | None:
        """The Anchor + Residual bytes sent for `room` (every destination), once; None if the
        room was not sent (failed, or already taken)."""
        return self._sent.take(room)

    def run(self, stop: threading.Event) -> None:
        """The dispatcher thread's loop: collect each room's chunks and hand the complete room to
        its destination's worker. A bug in handling one request must not stop the thread that
        serves every other one: it is logged and the loop goes on."""
        while not stop.is_set():
            try:
                items = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            ready: list[Job] = []
            for item in items:
                try:
                    job = self._handle(item)
                except Exception:
                    logger.exception("lynx: prefill dispatcher error (continuing)")
                    continue
                if job is not None:
                    ready.append(job)
            for group in _by_decode(ready):
                self._workers.dispatch(group)
        self.stopping.set()
        self.faults.release()
        if self.encoder is not None:
            self.encoder.shutdown(wait=False, cancel_futures=True)

    def _handle(self, item: _Chunk) -> Job | None:
        """Take one chunk; returns the room's job once its last chunk completes it, if it is to
        be sent now (a layer-streamed room is already with its worker)."""
        room = item.room
        if not self.link.is_live(room):
            self._pending.pop(room, None)
            self._hand_over(room, None, None, "SGLang dropped the room")
            return None
        if item.wait_event is not None:
            item.wait_event.synchronize()
        self._pending.setdefault(room, []).append(item.kv_indices)
        if not item.is_last:
            return None
        slots = np.concatenate(self._pending.pop(room))
        if self._hand_over(room, item, slots, None):
            return None
        tr = trace.Trace("prefill", room, sglang_ctx=item.trace_ctx)
        tr.mark("submitted", item.submitted)
        destinations = self.link.destinations(room)
        if not destinations:
            self.link.report(room, None, [])
            return None
        return Job(room, slots, item.aux_index, destinations, tr, ready_at=time.monotonic())

    def _hand_over(self, room: int, item: _Chunk | None, slots: np.ndarray | None,
                   refused: str | None) -> bool:
        """SGLang hands over (or drops) a room whose forward streamed its layers: give its job
        the aux index, or the reason it cannot be sent. False if the room was not streamed."""
        job = self._streamed.pop(room)
        if job is None:
            return False
        if item is not None:
            job.trace.mark("submitted", item.submitted)
            job.trace.sglang_ctx = item.trace_ctx
            job.aux_index = item.aux_index
            if job.refused is None and not np.array_equal(slots, job.slots):
                refused = (f"SGLang handed over {len(slots)} KV slots that differ from the "
                           f"{len(job.slots)} its forward wrote")
        job.refused = job.refused or refused
        job.handed_over.set()
        return True


def _by_decode(jobs: list[Job]) -> list[list[Job]]:
    """Rooms grouped by the decode address of their worker, in order; a room with several
    destinations goes alone (a group sends to one decode each)."""
    groups: dict[str, list[Job]] = {}
    alone: list[list[Job]] = []
    for job in jobs:
        if len(job.destinations) == 1:
            groups.setdefault(job.destinations[0].session_address, []).append(job)
        else:
            alone.append([job])
    return alone + list(groups.values())
