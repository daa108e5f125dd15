"""How one request's KV cache becomes the two Lynx byte streams, and back into a KV pool.

The layout of the streams is the request's `StreamPlan` (`backend.plan`): per layer, the K run's
chunks then the V run's (an MLA pool's latent: one run, `backend.pool`). Every call here is one
fused codec call per (layer, kind) run
(`lynx_kernels.fused`: the C kernels on CPU pools, one GIL-free call each): pool rows are encoded
straight into staging, and landed staging bytes are applied straight into pool rows, with no
intermediate tensors or chunk objects.

Prefill (`backend.prefill.writer`, a destination worker's thread): `encode_layer_into` writes a
layer's Anchor (and, when given a buffer, its Residual) into staging. Decode (`backend.decode.applier`,
applier thread): the Anchor of layer l lies at the plan's fixed offset (`anchor_layer`); an exact
Residual's size depends on the values, so a `ResidualReader` walks the chunk headers of the landed
Residual bytes to find each layer's runs; `apply_anchor_layer` / `apply_full_layer` then
validate every chunk of the layer (header, CRC, tiling, and for the exact Residual every
correction) before writing anything, and write only the request's slots.

Buffers: the `LayerRuns` views point into the decode's staging range; they are valid until the
room's staging range is freed, which the applier does only after the room is concluded or failed.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

import torch

from lynx_kernels import CodecError, CodecSpec, StreamKind, fused
from lynx_kernels.chunk_copy import COPY_TIMEOUT_S
from lynx_kernels.wire import HEADER, MAGIC

from ..errors import KVStreamError
from .plan import StreamPlan
from .pool import KINDS, LATENT_KINDS, KVPoolView

logger = logging.getLogger(__name__)

# Header fields the reader needs (lynx_kernels.wire.HEADER's order).
_F_MAGIC, _F_STREAM, _F_KIND, _F_BITS, _F_LAYER, _F_START, _F_END, _F_PAYLOAD = (
    0, 2, 3, 6, 8, 16, 17, 18)
# The header's kind field (lynx_kernels.wire).
_KIND_CODE = {StreamKind.K: 0, StreamKind.V: 1}


@dataclass(frozen=True)
class LayerRuns:
    """One layer's bytes of one stream: each kind's run of chunks (K's then V's, or the MLA
    latent's alone)."""

    kinds: tuple[StreamKind, ...]
    runs: tuple[memoryview, ...]

    def of(self, kind: StreamKind) -> memoryview:
        return self.runs[self.kinds.index(kind)]


class PendingLayer:
    """One layer's encode (`encode_layer_start`) whose device-to-host copies may still be running;
    `finish` waits for them. Every wait is bounded (`fused.PendingRun.finish`)."""

    def __init__(self, layer: int, runs: list[fused.PendingRun | Future], residual_out,
                 k_res_at: int, copying: bool):
        self.layer = layer
        # Whether device-to-host copies may still be running when `encode_layer_start` returns
        # (a CUDA pool); False: `finish` waits for nothing but a V run on the executor thread.
        self.copying = copying
        self._runs = runs  # K's (or the latent's), then V's: a future where V ran on the executor
        self._residual_out, self._k_res_at = residual_out, k_res_at
        self._written: tuple[int, int] | None = None

    def settle(self, timeout_s: float = COPY_TIMEOUT_S) -> None:
        """After a failure: wait for whatever of the layer is still being written, ignoring its
        errors (the failure that called this is the one reported)."""
        _settle(self.layer, self._runs, timeout_s)

    def finish(self, timeout_s: float) -> tuple[int, int]:
        """(Anchor bytes, Residual bytes) of the layer once written; idempotent."""
        if self._written is not None:
            return self._written
        done: list[tuple[int, int]] = []
        try:
            for r in self._runs:
                done.append(_finish_run(r, timeout_s))
        except BaseException as exc:
            # K failed while V may still be written (on the executor, or by its copies): the
            # caller may give the buffers back once this returns.
            _settle(self.layer, self._runs[len(done) + 1:], timeout_s)
            if isinstance(exc, (CodecError, TimeoutError)):
                raise KVStreamError(f"encoding layer {self.layer}: {exc}") from exc
            raise
        (ka, kr), *rest = done
        if not rest:
            self._written = ka, kr
            return self._written
        (va, vr), = rest
        out = self._residual_out
        if out is not None and kr != self._k_res_at:
            out[kr: kr + vr] = out[self._k_res_at: self._k_res_at + vr].copy()
        self._written = ka + va, kr + vr
        return self._written


def _finish_run(run: fused.PendingRun | Future, timeout_s: float) -> tuple[int, int]:
    """A run's (Anchor, Residual) bytes once written (a V run on the executor: once it ran)."""
    return (run.result(timeout_s) if isinstance(run, Future) else run).finish(timeout_s)


def _settle(layer: int, runs: list[fused.PendingRun | Future], timeout_s: float) -> None:
    """Wait for `runs` to end, ignoring their errors (after a failure, which is the one
    reported)."""
    for r in runs:
        try:
            _finish_run(r, timeout_s)
        except Exception as exc:  # a symptom of the failure being reported
            logger.warning("lynx: layer %d's encode after a failure: %s", layer, exc)


def encode_layer_start(pool: KVPoolView, layer: int, slots: torch.Tensor, spec: CodecSpec,
                       chunk_tokens: int, request_tag: int, anchor_out, residual_out=None,
                       executor: Executor | None = None) -> PendingLayer:
    """Encode one layer (K then V, or the MLA latent) of the tokens held in `slots`: its Anchor
    chunks back to back into `anchor_out`, and, if `residual_out` is given, its Residual chunks
    into that (None: the Anchor only, see `lynx_kernels.fused.encode_run_into`). The buffers are
    written once the returned layer's `finish` has returned (a CPU pool's at once; a CUDA pool's
    device-to-host copies run meanwhile, `lynx_kernels.chunk_copy`).

    With `executor` and two kinds, K and V are encoded at once (the C codec releases the GIL):
    V's Residual is written after K's bound and moved down next to K's real end by `finish` (an
    exact Residual's length is known only once it is coded)."""
    k_size = fused.run_nbytes(spec, StreamKind.K, pool.layer(layer, StreamKind.K).dtype,
                              *pool.layer(layer, StreamKind.K).shape[1:], len(slots),
                              chunk_tokens)
    k_res_at = 0 if residual_out is None else k_size.residual_bound

    def run(kind: StreamKind, a_at: int, r_at: int) -> fused.PendingRun:
        return fused.encode_run_start(
            pool.layer(layer, kind), slots, spec, kind, layer, chunk_tokens, request_tag,
            anchor_out[a_at:], None if residual_out is None else residual_out[r_at:])

    started: list[fused.PendingRun | Future] = []
    try:
        if pool.kinds == LATENT_KINDS:
            started.append(run(StreamKind.K, 0, 0))
        elif executor is None:
            # V's place follows K's bytes: K's must have landed to be counted.
            started.append(run(StreamKind.K, 0, 0))
            ka, kr = started[0].finish()
            started.append(run(StreamKind.V, ka, kr))
            k_res_at = kr
        else:
            started.append(executor.submit(run, StreamKind.V, k_size.anchor, k_res_at))
            started.insert(0, run(StreamKind.K, 0, 0))
    except BaseException as exc:
        # A run already started may still be copying into the buffers: let it land before the
        # caller can give them back.
        PendingLayer(layer, started, None, k_res_at, True).settle()
        if isinstance(exc, CodecError):
            raise KVStreamError(f"encoding layer {layer}: {exc}") from exc
        raise
    runs = started
    copying = pool.layer(layer, StreamKind.K).device.type != "cpu"
    return PendingLayer(layer, runs, residual_out, k_res_at, copying)


def encode_layer_into(pool: KVPoolView, layer: int, slots: torch.Tensor, spec: CodecSpec,
                      chunk_tokens: int, request_tag: int, anchor_out, residual_out=None,
                      executor: Executor | None = None,
                      timeout_s: float = COPY_TIMEOUT_S) -> tuple[int, int]:
    """`encode_layer_start` and its `finish`: the bytes written to each buffer."""
    return encode_layer_start(pool, layer, slots, spec, chunk_tokens, request_tag, anchor_out,
                              residual_out, executor).finish(timeout_s)


def anchor_layer(view: memoryview, plan: StreamPlan, layer: int) -> LayerRuns:
    """Layer `layer`'s runs in a landed Anchor stream (fixed offsets: nothing is read)."""
    at = plan.anchor_offset(layer)
    runs = []
    for size in plan.anchor_run_bytes:
        runs.append(view[at: at + size])
        at += size
    return LayerRuns(plan.kinds, tuple(runs))


def anchor_bits_of(view: memoryview) -> int:
    """The Anchor width the first chunk of a landed Anchor stream names (its header's first
    `HEADER.size` bytes must be in `view`); KVStreamError if that is no Anchor chunk. The rest
    of the header (and the chunk's CRC) is checked when the layer is applied."""
    h = HEADER.unpack_from(view, 0)
    if h[_F_MAGIC] != MAGIC or h[_F_STREAM] != 0:
        raise KVStreamError("the Anchor stream does not start with a Lynx Anchor chunk")
    return h[_F_BITS]


def _each_kind(write, layer: int, what: str, kinds: tuple[StreamKind, ...],
               executor: Executor | None) -> None:
    """`write(kind)` for each kind the pool holds: with `executor` and K and V, V on it while K
    runs here (the C codec releases the GIL, and the two kinds are separate pool tensors). Either
    kind's codec error is raised once both have ended, so neither call is left running on the
    room's buffers."""
    def run(kind: StreamKind) -> None:
        try:
            write(kind)
        except CodecError as exc:
            raise KVStreamError(f"{what} {kind.value.upper()} of layer {layer}: {exc}") from exc

    if executor is None or kinds == LATENT_KINDS:
        for kind in kinds:
            run(kind)
        return
    v = executor.submit(run, StreamKind.V)
    try:
        run(StreamKind.K)
    finally:
        wait([v])
    v.result()


def apply_anchor_layer(anchor: LayerRuns, pool: KVPoolView, layer: int, slots: torch.Tensor,
                       spec: CodecSpec, request_tag: int,
                       executor: Executor | None = None) -> None:
    """Validate one layer's Anchor runs and write their reconstruction into the pool's `slots`
    (K and V at once with `executor`)."""
    _each_kind(lambda kind: fused.apply_anchor_run(
        anchor.of(kind), pool.layer(layer, kind), slots, spec, kind, layer, request_tag,
        len(slots)), layer, "the Anchor", pool.kinds, executor)


def apply_full_layer(anchor: LayerRuns, residual: LayerRuns, pool: KVPoolView, layer: int,
                     slots: torch.Tensor, spec: CodecSpec, request_tag: int,
                     executor: Executor | None = None) -> None:
    """Validate one layer's Anchor and Residual runs and write its full-precision values (K and
    V at once with `executor`)."""
    _each_kind(lambda kind: fused.apply_residual_run(
        anchor.of(kind), residual.of(kind), pool.layer(layer, kind), slots, spec, kind, layer,
        request_tag, len(slots)), layer, "the Residual", pool.kinds, executor)


class ResidualReader:
    """Finds the layers of a Residual stream while it lands. `advance(view, landed)` walks the
    chunk headers among the first `landed` bytes and returns the layers whose runs are complete,
    in layer order. The stream's runs come layer by layer, one per kind of `kinds` in order (K
    then V; an MLA pool's latent alone), each tiling the request's tokens (the prefill writes
    them so); anything else is refused here. The chunks themselves (CRC, settings, corrections)
    are validated when the layer is applied."""

    def __init__(self, num_layers: int, num_tokens: int, first_layer: int = 0,
                 kinds: tuple[StreamKind, ...] = KINDS):
        # The stream holds layers [first_layer, first_layer + num_layers) (a windowed room's
        # segment holds a few; `backend.window`).
        self.end_layer, self.num_tokens = first_layer + num_layers, num_tokens
        self.kinds = kinds
        self.pos = 0
        self.next_layer = first_layer
        self._run_start = 0  # where the current layer's current run starts
        self._runs: list[memoryview] = []  # the current layer's complete runs
        self._covered = 0  # tokens of the current run so far

    @property
    def done(self) -> bool:
        return self.next_layer == self.end_layer

    def advance(self, view: memoryview, landed: int) -> list[tuple[int, LayerRuns]]:
        ready = []
        while not self.done and landed - self.pos >= HEADER.size:
            h = HEADER.unpack_from(view, self.pos)
            end = self.pos + HEADER.size + h[_F_PAYLOAD]
            kind = self.kinds[len(self._runs)]
            where = f"Residual chunk at byte {self.pos}"
            if h[_F_MAGIC] != MAGIC:
                raise KVStreamError(f"{where} is not a Lynx chunk")
            if end > len(view):
                raise KVStreamError(f"{where} runs past the stream end ({end} > {len(view)})")
            if h[_F_LAYER] != self.next_layer or h[_F_KIND] != _KIND_CODE[kind]:
                raise KVStreamError(f"{where} is of layer {h[_F_LAYER]} kind {h[_F_KIND]} while "
                                    f"layer {self.next_layer} {kind.value.upper()} is incomplete")
            if h[_F_START] != self._covered or not self._covered < h[_F_END] <= self.num_tokens:
                raise KVStreamError(f"{where} holds tokens [{h[_F_START]}, {h[_F_END]}) where "
                                    f"[{self._covered}, ...) of {self.num_tokens} belong")
            if end > landed:
                break
            self.pos = end
            self._covered = h[_F_END]
            if self._covered < self.num_tokens:
                continue
            self._covered = 0
            self._runs.append(view[self._run_start:end])
            self._run_start = end
            if len(self._runs) < len(self.kinds):
                continue
            ready.append((self.next_layer, LayerRuns(self.kinds, tuple(self._runs))))
            self.next_layer += 1
            self._runs = []
        return ready
