"""Layer streaming on the prefill: each layer's Anchor is encoded and sent while SGLang's prefill
forward computes the later layers, so that when the forward ends only its last layers are still
to send (without it, the whole Anchor's encode and wire time came after the forward).

`LayerStreamer` is one prefill scheduler's layer streaming, built by the KV manager for a CPU pool
(`LayerStreamer.for_pool`, held in the process's `runtime.LynxRuntime`). Two SGLang hooks drive it
(adapters in `lynx_sglang.hooks`):
- `run_batch` (`Scheduler.run_batch`, the scheduler thread): before an extend forward, each
  request of the batch whose prompt this forward completes (its only or last chunk; earlier
  chunks and a cached prefix are in the pool already) is handed to the sender at once, all in
  one call (`PrefillSender.start_early`, which sends the rooms bound for one decode layer by
  layer together) with the forward's `LayerGate`; after the forward, every layer is open.
- `layer_written` (`MHATokenToKVPool.set_kv_buffer`, inside the forward): layer l's KV of every
  request in the batch is in the pool: open layer l.

A forward that raises fails the gate, and the rooms waiting on it fail with the reason. Only CPU
pools stream: there `set_kv_buffer` has written the rows when it returns; on CUDA it has only
queued the kernel (per-layer events would be needed: not implemented, see `for_pool`).

The gate belongs to one forward; the room writer of the sender's destination worker
(`backend.prefill_writer`) waits on it before reading a layer's pool rows, which the forward never
writes again for these requests.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

logger = logging.getLogger(__name__)


class LayerGateError(RuntimeError):
    """The forward ended without writing the layer waited for (it raised)."""


class LayerGate:
    """Which layers of one prefill forward are in the KV pool. Opened in order by the scheduler
    thread (`written`, `finish`, `fail`); waited on by destination workers (`wait`)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._written = 0
        self._failure: str | None = None
        self._cond = threading.Condition()

    def written(self, layer: int) -> None:
        """Layer `layer` (and, the forward going in order, every layer before it) is written."""
        with self._cond:
            if layer + 1 > self._written:
                self._written = layer + 1
                self._cond.notify_all()

    @property
    def opened(self) -> int:
        """Layers written so far."""
        with self._cond:
            return self._written

    def finish(self) -> None:
        """The forward returned: every layer is written."""
        self.written(self.num_layers - 1)

    def fail(self, why: str) -> None:
        with self._cond:
            self._failure = why
            self._cond.notify_all()

    def wait(self, layer: int, timeout_s: float) -> None:
        """Return once `layer` is written; LayerGateError if the forward failed first, TimeoutError
        after `timeout_s`."""
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


def _prompt_slots(scheduler, req) -> np.ndarray | None:
    """The KV slots of `req`'s whole prompt if this forward completes it (its last or only
    chunk), else None. Whatever came before this forward (earlier chunks, a cached prefix) is in
    the pool for every layer already, so once this forward writes layer l, layer l is complete."""
    n = len(req.origin_input_ids)
    # A fully cached prompt computes only its last token again, and the prefix cache then swaps
    # that slot for its own copy, whose bits may differ: nothing to gain, and not streamable.
    if (getattr(req, "bootstrap_room", None) is None or req.extend_end != n
            or req.prefix_len >= n - 1 or req.kv.req_pool_idx is None):
        return None
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
    return row.to("cpu", copy=True).numpy().astype(np.int64, copy=False)


class LayerStreamer:
    """Layer streaming of one prefill scheduler: its sender (a `PrefillSender`) and the gate of the
    forward now running. Scheduler thread only (the gate itself is waited on by the workers)."""

    def __init__(self, sender, num_layers: int):
        self.sender = sender
        self.num_layers = num_layers
        self.gate: LayerGate | None = None
        self._said_how_layers_open = False

    @classmethod
    def for_pool(cls, sender, num_layers: int, device_type: str) -> LayerStreamer | None:
        """Layer streaming for `sender` over a pool on `device_type`; None where the pool cannot
        be read during the forward (not a CPU pool)."""
        if device_type != "cpu":
            logger.info("lynx: layer streaming off: the KV pool is on %s, where a layer's rows are "
                        "written only when its queued kernels run (per-layer events: not "
                        "implemented); each request's Anchor is sent after its forward", device_type)
            return None
        logger.info("lynx: layer streaming on: each layer's Anchor is sent while the prefill "
                    "forward computes the later layers (--no-lynx-layer-stream: after it)")
        return cls(sender, num_layers)

    def run_batch(self, original, scheduler, batch, *args, **kwargs):
        """SGLang's `run_batch`, with the rooms whose prompt an extend forward completes handed
        to the sender as it starts, behind this forward's gate."""
        if (self.gate is not None or not batch.forward_mode.is_extend()
                or getattr(scheduler, "enable_overlap", False)):
            return original(scheduler, batch, *args, **kwargs)
        gate = LayerGate(self.num_layers)
        rooms = []
        for req in batch.reqs:
            slots = _prompt_slots(scheduler, req)
            if slots is not None:
                rooms.append((req.bootstrap_room, slots))
        if not rooms or not self.sender.start_early(rooms, gate):
            return original(scheduler, batch, *args, **kwargs)
        self.gate = gate
        try:
            result = original(scheduler, batch, *args, **kwargs)
        except BaseException as exc:
            gate.fail(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.gate = None
        self._say_how_layers_opened(gate.opened)
        gate.finish()
        return result

    def layer_written(self, pool, layer, layer_id_override: int | None) -> None:
        """Inside the forward: `layer`'s KV rows of the batch are in `pool`."""
        gate = self.gate
        if gate is not None:
            layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
            gate.written(layer_id - getattr(pool, "start_layer", 0))

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
                           "MHATokenToKVPool.set_kv_buffer (a KV pool class that overrides it?): "
                           "each Anchor is sent after its forward")
