"""Layer streaming on the prefill: each layer's Anchor is encoded and sent while SGLang's prefill
forward computes the later layers, so that when the forward ends only its last layers are still
to send (without it, the whole Anchor's encode and wire time came after the forward).

`LayerStreamer` is one prefill scheduler's layer streaming, built by the KV manager for a CPU or
CUDA pool (`LayerStreamer.for_pool`, held in the process's `runtime.LynxRuntime`). Two SGLang
hooks drive it (adapters in `lynx_sglang.hooks`):
- `run_batch` (`Scheduler.run_batch`, the scheduler thread): before an extend forward, each
  request of the batch whose prompt this forward completes (its only or last chunk; earlier
  chunks and a cached prefix are in the pool already) is handed to the sender at once, all in
  one call (`PrefillSender.start_early`, which sends the rooms bound for one decode layer by
  layer together) with the forward's `LayerGate`; after the forward, every layer is open.
- `layer_written` (`MHATokenToKVPool.set_kv_buffer`, or an MLA pool's `set_kv_buffer` /
  `set_mla_kv_buffer`, inside the forward): layer l's KV of every request in the batch is in the
  pool (CPU), or queued to be written there (CUDA): open layer l.

A forward that raises fails the gate, and the rooms waiting on it fail with the reason.

SGLang's overlap scheduler (its default) changes neither hook's timing: `run_batch` still runs the
forward's Python, so each `set_kv_buffer` call happens inside it (CPU: the forward itself; CUDA:
its kernels queued on the scheduler's forward stream). What it moves is the hand-over: SGLang
processes forward N's results, and so hands its rooms over, after it has launched forward N+1
(on CPU, run it). Each forward has its own gate, and forward N's rooms wait for their hand-over
with their layers sent (`Job.await_handover`), so N+1's gate and rooms are independent of them.
The one overlap-specific step: on CUDA the forward ran on `scheduler.forward_stream`, which is no
longer current when `run_batch` returns, so the event after the forward is recorded there. (Also
on CUDA, not measured: reading the prompt's slots to the host, `_prompt_slots`, waits for the
scheduler's stream, which SGLang may have made wait for the previous forward; that launch then
no longer overlaps it.)
Not streamed, under either scheduler: a batch whose cached prefix HiCache is still loading into
the pool (`hicache_consumer_index`): SGLang's forward waits for a layer's load only when it reads
the layer (`get_key_buffer`), after its `set_kv_buffer`, so the layer's event would not cover the
prefix rows (SGLang's own early send of a cached prefix skips such a batch for the same reason).

CPU and CUDA pools share this scheduling; only the event differs (`EventFactory`, chosen by
`for_pool` from the pool's device). On a CPU pool `set_kv_buffer` has written the rows when it
returns: no event. On CUDA it has only queued the kernel on the forward's stream, so the hook
records a `torch.cuda.Event` there right after it (and `run_batch` one after the forward, for the
layers no hook reported) and the gate keeps it with the layer: a wait for layer l returns once the
layer is opened and its event has completed. The event is polled (`query`) off the scheduler
thread, on the waiting worker's, within the wait's deadline (`synchronize` has none).

The gate belongs to one forward; the room writer of the sender's destination worker
(`backend.prefill.writer`) waits on it before reading a layer's pool rows, which the forward never
writes again for these requests. On a CUDA pool the codec's Triton path (`lynx_kernels.fused`,
impl "auto") gathers and encodes the rows on the device, on the worker thread's current stream,
the default one; SGLang 0.5.23's scheduler runs the forward on a stream of its own (non-blocking),
so those reads do not queue behind the forward's later layers, and the event is what orders each
read after its write. The encoded bytes reach host staging by asynchronous copies that overlap
the next layer's encode (`lynx_kernels.chunk_copy`, `prefill_writer.RoomWriter`).
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from lynx_kernels.chunk_copy import await_event

from ...upstream import adapter as upstream_adapter

logger = logging.getLogger(__name__)


class LayerEvent(Protocol):
    """What the gate needs of a device event (`torch.cuda.Event`'s interface)."""

    def record(self, stream=None) -> None:
        """Mark the work queued so far on `stream` (None: the calling thread's current one)."""

    def query(self) -> bool:
        """Whether that work has completed."""


# Makes an unrecorded event (None: the pool's writes are done when the hook runs, as on CPU).
EventFactory = Callable[[], LayerEvent]


class LayerGateError(RuntimeError):
    """The forward ended without writing the layer waited for (it raised)."""


class LayerGate:
    """Which layers of one prefill forward are in the KV pool. Opened in order by the scheduler
    thread (`written`, `finish`, `fail`), each with the event of its write on a device pool;
    waited on by destination workers (`wait`)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._written = 0
        self._failure: str | None = None
        self._cond = threading.Condition()
        # Events of the device writes, by the layer each was recorded after (ascending): one
        # covers its layer and the unreported layers before it, queued earlier on the same stream.
        self._event_layers: list[int] = []
        self._events: list[LayerEvent] = []

    def written(self, layer: int, event: LayerEvent | None = None) -> None:
        """Layer `layer` (and, the forward going in order, every layer before it) is written, or
        on a device pool queued, `event` recorded after its write."""
        with self._cond:
            if layer + 1 > self._written:
                self._written = layer + 1
                if event is not None:
                    self._event_layers.append(layer)
                    self._events.append(event)
                self._cond.notify_all()

    @property
    def opened(self) -> int:
        """Layers written so far."""
        with self._cond:
            return self._written

    def finish(self, event: LayerEvent | None = None) -> None:
        """The forward returned: every layer is written (device pool: queued, `event` after)."""
        self.written(self.num_layers - 1, event)

    def fail(self, why: str) -> None:
        with self._cond:
            self._failure = why
            self._cond.notify_all()

    def wait(self, layer: int, timeout_s: float) -> None:
        """Return once `layer` is written (device pool: once its event has completed);
        LayerGateError if the forward failed first, TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._written <= layer:
                if self._failure is not None:
                    raise LayerGateError(f"the prefill forward failed before layer {layer} was "
                                         f"written: {self._failure}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"layer {layer} of the prefill forward not written within "
                                       f"{timeout_s:g} s")
                self._cond.wait(left)
            at = bisect_left(self._event_layers, layer)
            event = self._events[at] if at < len(self._events) else None
        if event is not None:
            # Outside the lock: the scheduler thread opens later layers meanwhile. A forward that
            # failed after queueing this layer's write still completes it, so a failure does not
            # end this wait; a broken device does (`query` raises).
            await_event(event, deadline, f"layer {layer} of the prefill forward queued but not "
                        f"written on the device within {timeout_s:g} s")


def _prompt_slots(scheduler, req) -> np.ndarray | None:
    """The KV slots of `req`'s whole prompt if this forward completes it (its last or only
    chunk), else None. Whatever came before this forward (earlier chunks, a cached prefix) is in
    the pool for every layer already, so once this forward writes layer l, layer l is complete."""
    n = len(req.origin_input_ids)
    # A fully cached prompt computes only its last token again, and the prefix cache then swaps
    # that slot for its own copy, whose bits may differ: nothing to gain, and not streamable.
    if getattr(req, "bootstrap_room", None) is None or req.kv.req_pool_idx is None:
        return None
    prefix_len, extend_end = upstream_adapter.scheduler().extend_bounds(req)
    if extend_end != n or prefix_len >= n - 1:
        return None
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
    return row.to("cpu", copy=True).numpy().astype(np.int64, copy=False)


class LayerStreamer:
    """Layer streaming of one prefill scheduler: its sender (a `PrefillSender`) and the gate of the
    forward now running. Scheduler thread only (the gate itself is waited on by the workers)."""

    def __init__(self, sender, num_layers: int, make_event: EventFactory | None = None):
        self.sender = sender
        self.num_layers = num_layers
        self.make_event = make_event
        self.gate: LayerGate | None = None
        self._said_how_layers_open = False

    @classmethod
    def for_pool(cls, sender, num_layers: int, device_type: str) -> LayerStreamer | None:
        """Layer streaming for `sender` over a pool on `device_type`, with the event its writes
        need (CUDA: `torch.cuda.Event`; CPU: none); None where the pool cannot be read during the
        forward (any other device)."""
        if device_type == "cpu":
            logger.info("lynx: layer streaming on: each layer's Anchor is sent while the prefill "
                        "forward computes the later layers, where the link is slow enough for "
                        "that to pay (--lynx-layer-stream-min-share; --no-lynx-layer-stream: "
                        "always after the forward)")
            return cls(sender, num_layers)
        if device_type == "cuda":
            logger.info("lynx: layer streaming on: per-layer CUDA events; each layer's Anchor is "
                        "sent once the forward's kernels have written it, while they compute the "
                        "later layers (--no-lynx-layer-stream: after the forward)")
            return cls(sender, num_layers, torch.cuda.Event)
        logger.info("lynx: layer streaming off: the KV pool is on %s, where a layer's rows are "
                    "written only when its queued kernels run (per-layer events: CUDA only); "
                    "each request's Anchor is sent after its forward", device_type)
        return None

    def run_batch(self, original, scheduler, batch, *args, **kwargs):
        """SGLang's `run_batch`, with the rooms whose prompt an extend forward completes handed
        to the sender as it starts, behind this forward's gate (those its `stream_policy` finds
        worth streaming, on a CPU pool, whose extend forwards are timed for it)."""
        if (self.gate is not None or not batch.forward_mode.is_extend()
                or getattr(batch, "hicache_consumer_index", -1) >= 0):
            return original(scheduler, batch, *args, **kwargs)
        # A CUDA forward's kernels run after run_batch returns: only a CPU one is timed here.
        tokens = (getattr(batch, "extend_num_tokens", None) or 0) if self.make_event is None else 0
        started = time.monotonic()
        gate = LayerGate(self.num_layers)
        rooms = []
        for req in batch.reqs:
            slots = _prompt_slots(scheduler, req)
            if slots is not None:
                rooms.append((req.bootstrap_room, slots))
        if not rooms or not self.sender.start_early(rooms, gate, tokens or None):
            result = original(scheduler, batch, *args, **kwargs)
            self.sender.stream_policy.observe_forward(tokens, time.monotonic() - started)
            return result
        self.gate = gate
        try:
            result = original(scheduler, batch, *args, **kwargs)
        except BaseException as exc:
            gate.fail(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.gate = None
        self.sender.stream_policy.observe_forward(tokens, time.monotonic() - started)
        self._say_how_layers_opened(gate.opened)
        # Overlap: SGLang ran the forward on its forward stream, current only inside run_batch.
        gate.finish(self._recorded_event(
            scheduler.forward_stream if getattr(scheduler, "enable_overlap", False) else None))
        return result

    def layer_written(self, pool, layer, layer_id_override: int | None) -> None:
        """Inside the forward: `layer`'s KV rows of the batch are in `pool` (CUDA: queued)."""
        gate = self.gate
        if gate is not None:
            layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
            gate.written(layer_id - getattr(pool, "start_layer", 0), self._recorded_event())

    def _recorded_event(self, stream=None) -> LayerEvent | None:
        """On a device pool, an event recorded after the work queued so far on the forward's
        stream: `stream`, or (None) the scheduler thread's current one; None on a CPU pool."""
        if self.make_event is None:
            return None
        event = self.make_event()
        event.record(stream)
        return event

    def _say_how_layers_opened(self, opened: int) -> None:
        """Once: whether the first streamed forward opened its layers one by one."""
        if self._said_how_layers_open:
            return
        self._said_how_layers_open = True
        if opened:
            logger.info("lynx: layer streaming: the first streamed forward opened %d of %d layers "
                        "before it ended", opened, self.num_layers)
        else:
            logger.warning("lynx: layer streaming: the forward wrote no layer through "
                           "the hooked set_kv_buffer methods (a KV pool class that overrides "
                           "them?): "
                           "each Anchor is sent after its forward")
