"""A room the prefill is sending (`Job`): made by `backend.prefill.sender.PrefillSender` when the room's
last chunk arrives (or, layer-streamed, when its forward starts), sent by the destination worker
of its decode (`backend.prefill.worker`), read layer by layer by its room writer
(`backend.prefill.writer`). Also what a layer-streamed job carries between the scheduler thread
and its worker: the forward's own rows where SGLang's prefix cache swapped slots (`KeptRows`), and
the registry of streamed jobs awaiting SGLang's hand-over (`StreamedJobs`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from lynx_kernels import StreamKind

from ... import trace
from ...errors import KVStreamError, RoomDroppedError
from ..pool import KVPoolView
from .layer_stream import LayerGate
from .link import Destination

# How often a layer-streamed room waiting for SGLang's hand-over checks that SGLang still has it.
HANDOVER_POLL_S = 0.05


@dataclass
class Job:
    """A room whose last chunk arrived (or, layer-streamed, whose forward started): everything a
    destination worker needs to send it."""

    room: int
    slots: np.ndarray
    aux_index: int | None
    destinations: list[Destination]
    trace: trace.Trace
    # Layer-streamed (`start_early`): the forward's layers written so far, and SGLang's hand-over
    # of the room after the forward (`handed_over`; `refused` says why the room cannot be sent).
    gate: LayerGate | None = None
    # Sent after its forward: when the room was ready to send (monotonic), from which its
    # Anchor's delivery time measures the link (`backend.prefill.stream_policy`).
    ready_at: float | None = None
    # Layer-streamed: the prompt tokens of the forward it streams beside (the forward's predicted
    # time weighs the Anchor's width, `backend.prefill.anchor_width`).
    forward_tokens: int | None = None
    handed_over: threading.Event = field(default_factory=threading.Event)
    refused: str | None = None
    # Held by the worker while it reads pool rows of `slots`, and by `_reconcile_streamed` while
    # it replaces slots SGLang's prefix cache swapped after the forward.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Set by `_reconcile_streamed` when the swapped-in slots hold other bits: the forward's own.
    kept: KeptRows | None = None
    # `slots` as last seen by `rows_of`, and as a tensor on the pool's device (one copy per
    # room, not per layer, on a CUDA pool).
    _on_device: tuple = (None, None)

    def rows_of(self, pool: KVPoolView, layer: int):
        """What `encode_layer_into` reads this layer from (under `lock`): the pool and the room's
        slots there, or, with `kept` rows, a gathered copy of the layer and its row numbers."""
        if self._on_device[0] is not self.slots:
            self._on_device = (self.slots, torch.as_tensor(self.slots, device=pool.device))
        if self.kept is None:
            return pool, self._on_device[1]
        return self.kept.layer_view(pool, layer, self._on_device[1]), self.kept.order

    def await_handover(self, is_live, timeout_s: float) -> None:
        """Layer-streamed: wait until SGLang hands the room over after its forward (the aux data,
        the first token, exists only then), or drops it (`is_live(room)` False); at most
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self.handed_over.wait(HANDOVER_POLL_S):
            if not is_live(self.room):
                raise RoomDroppedError("SGLang dropped the room during its forward")
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang did not hand the room over within "
                                   f"{timeout_s:g} s of its forward")
        if self.refused is not None:
            raise KVStreamError(self.refused)


@dataclass
class KeptRows:
    """Copies of the KV a layer-streamed forward wrote at the positions of its room whose slots
    SGLang's prefix cache swapped for cached slots holding other bits (two requests computed the
    same tokens in different batches). Made on the scheduler thread before the forward's slots
    can be written again, so the whole room is sent as its forward computed it: the KV its first
    token came from, and the Anchor layers already sent. Owned by the job, freed with it; at most
    the room's own KV at those positions."""

    positions: torch.Tensor  # into the room's slots
    k: list[torch.Tensor]  # per layer: [len(positions), kv_heads, head_dim]
    v: list[torch.Tensor]  # empty for an MLA pool (no V)
    order: torch.Tensor  # 0..len(slots)-1: the rows of a `layer_view`, in slot order

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def layer_view(self, pool: KVPoolView, layer: int, slots: torch.Tensor) -> LayerRows:
        k = pool.read(layer, StreamKind.K, slots)
        k[self.positions] = self.k[layer]
        v = None
        if self.v:
            v = pool.read(layer, StreamKind.V, slots)
            v[self.positions] = self.v[layer]
        return LayerRows(layer, k, v, pool.kinds)


@dataclass
class LayerRows:
    """One layer of one room in slot order (`KVPoolView.layer`'s interface, that layer only)."""

    index: int
    k: torch.Tensor
    v: torch.Tensor | None
    kinds: tuple[StreamKind, ...]

    def layer(self, layer: int, kind: StreamKind) -> torch.Tensor:
        assert layer == self.index, (layer, self.index)
        return self.k if kind is StreamKind.K else self.v


class StreamedJobs:
    """Layer-streamed rooms whose forward runs or has not been handed over yet, by room: added by
    `PrefillSender.start_early`, taken at SGLang's hand-over (`pop`), forgotten by the worker once
    the room is sent or failed (`forget`). Thread-safe."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Job) -> bool:
        """False if the room is streamed already."""
        with self._lock:
            if job.room in self._jobs:
                return False
            self._jobs[job.room] = job
            return True

    def get(self, room: int) -> Job | None:
        with self._lock:
            return self._jobs.get(room)

    def pop(self, room: int) -> Job | None:
        with self._lock:
            return self._jobs.pop(room, None)

    def forget(self, job: Job) -> None:
        with self._lock:
            if self._jobs.get(job.room) is job:
                del self._jobs[job.room]
