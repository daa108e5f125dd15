"""The serving path's codec calls, one per (layer, kind) of a request: encode KV pool rows straight
into the two streams' bytes, and apply landed bytes straight into pool rows.

Called by the SGLang backend: the prefill calls `encode_run_start` (`encode_run_into` when it does
not overlap a device run's copy with the next encode) for each layer's K and V, the
decode `apply_anchor_run` once the Anchor stream has landed and `apply_residual_run` once the
Residual has. A run is the `total_tokens` tokens of one layer's K or V held in `pool_layer[slots]`
(`pool_layer`: `[rows, kv_heads, head_dim]`), cut every `chunk_tokens` tokens into wire chunks
(`lynx_kernels.wire`); its Anchor chunks lie back to back in one buffer, its Residual chunks in
another, in token order.

impl: "cpu" the C kernels (`lynx_kernels.ops_cpu`: one C call per run, GIL released); "torch" the
reference (`codec` + `wire`); "triton" the reference with the Triton per-value kernels (CUDA
pools; the exact Residual's bit coding by `lynx_kernels.exact_triton`, see `wire.section_coder`);
"auto" = triton for CUDA pools, cpu for CPU pools when the C extension is built, torch otherwise
(with a one-time warning). Every impl writes the same bytes and the same pool values.

Buffers: `encode_run_into` writes `anchor_out[:anchor_bytes]` and `residual_out[:residual_bytes]`
(both must hold `run_nbytes`: the Anchor's exact size and the Residual's bound) and keeps no
reference to them or to the pool: when it returns the caller may hand the bytes to the transport
or reuse the buffers, and reuse the pool rows. `encode_run_start` is done with the pool when it
returns, with the buffers when its `PendingRun.finish` has returned. `apply_*` read their byte
buffers and `slots` only during the call and write only `pool_layer[slots]`; they validate every
chunk (and for the exact Residual decode every correction) before writing anything, so a
CodecError leaves the pool as it was.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import ops_cpu
from .chunk_copy import COPY_TIMEOUT_S, PendingChunks, wait_for_stream
from .codec import check_input, decode, encode, parse_kind
from .deferred_checks import DeferredChecks, PendingChecks
from .spec import CodecError, CodecSpec, StreamKind
from .wire import (
    HEADER,
    Chunk,
    ChunkHeader,
    DeviceCopy,
    WireStream,
    assemble,
    parse_chunk,
    spec_flags,
)
from .wire_write import start_chunks

IMPLS = ("auto", "torch", "cpu", "triton")
_U16, _U32, _U64 = 2**16, 2**32, 2**64


@dataclass(frozen=True)
class RunBytes:
    """Wire bytes of one run's streams, headers included: the Anchor's exactly, the Residual's
    bound (an exact Residual is usually shorter; `encode_run_into` returns its real length)."""

    anchor: int
    residual_bound: int


@functools.lru_cache(maxsize=256)
def run_nbytes(spec: CodecSpec, kind: StreamKind | str, dtype: torch.dtype, heads: int,
               head_dim: int, total_tokens: int, chunk_tokens: int) -> RunBytes:
    # Cached: a server asks for the same few layouts once per layer and kind of every request.
    anchor = residual = 0
    for start in range(0, total_tokens, chunk_tokens):
        header = ChunkHeader(
            stream=WireStream.ANCHOR, spec=spec, kind=StreamKind(kind), dtype=dtype, layer=0,
            num_heads=heads, head_dim=head_dim, request_tag=0, total_tokens=total_tokens,
            token_start=start, token_end=min(start + chunk_tokens, total_tokens), payload_len=0)
        anchor += HEADER.size + header.bound()
        residual += HEADER.size + replace(header, stream=WireStream.RESIDUAL).bound()
    return RunBytes(anchor, residual)


@dataclass(frozen=True)
class _Run:
    """A validated call: what every chunk of the run must say, and which implementation runs."""

    spec: CodecSpec
    kind: StreamKind
    layer: int
    request_tag: int
    pool: torch.Tensor
    slots: torch.Tensor
    impl: str

    @property
    def total_tokens(self) -> int:
        return len(self.slots)

    def sizes(self, chunk_tokens: int) -> RunBytes:
        _, heads, head_dim = self.pool.shape
        return run_nbytes(self.spec, self.kind, self.pool.dtype, heads, head_dim,
                          self.total_tokens, chunk_tokens)

    def expect(self, h: ChunkHeader, stream: WireStream, start: int) -> None:
        what = f"layer {self.layer} {self.kind.value.upper()} {stream.name}"
        if h.stream is not stream:
            raise CodecError(f"{what}: expected an {stream.name} chunk, got {h.stream.name}")
        if h.spec != self.spec or h.kind is not self.kind or h.dtype != self.pool.dtype:
            raise CodecError(f"{what}: chunk settings ({h.spec}, {h.kind.value}, {h.dtype}) differ "
                             f"from this run's ({self.spec}, {self.pool.dtype})")
        _, heads, head_dim = self.pool.shape
        if (h.layer, h.num_heads, h.head_dim, h.request_tag, h.total_tokens) != (
                self.layer, heads, head_dim, self.request_tag, self.total_tokens):
            raise CodecError(f"{what}: chunk of layer {h.layer} (tag {h.request_tag}, "
                             f"{h.total_tokens} tokens, {h.num_heads}x{h.head_dim}) does not "
                             "belong to this run")
        if h.token_start != start:
            raise CodecError(f"{what}: chunks do not tile the run: expected one starting at token "
                             f"{start}, got [{h.token_start}, {h.token_end})")


@functools.cache
def _warn_torch_fallback() -> None:
    warnings.warn(f"lynx_kernels: the C kernels are unavailable ({ops_cpu.unavailable_reason()}); "
                  "impl='auto' runs the much slower torch reference on CPU", RuntimeWarning,
                  stacklevel=4)


def _resolve(impl: str, pool: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise CodecError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        if pool.device.type == "cuda":
            return "triton"
        if ops_cpu.available():
            return "cpu"
        _warn_torch_fallback()
        return "torch"
    if impl == "cpu":
        if pool.device.type != "cpu":
            raise CodecError(f"impl='cpu' needs a CPU pool, got one on {pool.device}")
        if not ops_cpu.available():
            raise CodecError(f"impl='cpu' needs the C extension: {ops_cpu.unavailable_reason()}")
        if pool.stride(2) != 1 or pool.stride(1) != pool.shape[2]:
            raise CodecError("impl='cpu' needs each pool row's [kv_heads, head_dim] contiguous, got "
                             f"strides {pool.stride()}")
    return impl


def _run(pool: torch.Tensor, slots: torch.Tensor, spec: CodecSpec, kind: StreamKind | str,
         layer: int, request_tag: int, total_tokens: int, impl: str,
         checks: DeferredChecks | None = None) -> _Run:
    """The call's arguments checked. With `checks` (an encode), unless the C codec runs it, the
    slots' range is checked when `checks` is read, not here (a host wait for a device's
    slots), and the run's `slots` are clamped to the pool meanwhile: the gather of a row outside
    it would be a device fault, not an error."""
    if not isinstance(spec, CodecSpec):
        raise CodecError(f"spec must be a CodecSpec, got {type(spec).__name__}")
    kind = parse_kind(kind)
    check_input(pool, spec, kind, layer)
    _, heads, head_dim = pool.shape
    if not (0 <= layer < _U16 and heads < _U16 and head_dim < _U16):
        raise CodecError(f"layer {layer}, kv_heads {heads} and head_dim {head_dim} must fit in "
                         "16 bits")
    if not 0 <= request_tag < _U64:
        raise CodecError(f"request_tag must fit in 64 bits, got {request_tag}")
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
        raise CodecError("slots must be a 1-D int64 tensor")
    if slots.device != pool.device:
        raise CodecError(f"slots are on {slots.device}, the pool on {pool.device}")
    if not 0 < total_tokens < _U32 or len(slots) != total_tokens:
        raise CodecError(f"a run of {total_tokens} tokens needs as many slots, got {len(slots)}")
    impl = _resolve(impl, pool)
    rows = pool.shape[0]
    low, high = torch.aminmax(slots)
    if checks is not None and impl != "cpu":
        checks.add((low < 0) | (high >= rows), functools.partial(_slots_error, low, high, rows))
        slots = slots.clamp(0, rows - 1)
    elif int(low) < 0 or int(high) >= rows:
        raise _slots_error(low, high, rows)
    return _Run(spec, kind, layer, request_tag, pool, slots.contiguous(), impl)


def _slots_error(low: torch.Tensor, high: torch.Tensor, rows: int) -> CodecError:
    return CodecError(f"slots span [{int(low)}, {int(high)}], outside the pool's {rows} rows")


def _bytes(buf, what: str) -> np.ndarray:
    """A byte buffer (bytes, bytearray, memoryview, numpy array, CPU uint8 tensor) as a uint8 view."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise CodecError(f"{what} must be a contiguous CPU uint8 tensor")
        return buf.view(-1).numpy()
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise CodecError(f"{what} is not a contiguous byte buffer: {exc}") from None


def _out(buf, need: int, what: str) -> np.ndarray:
    arr = _bytes(buf, what)
    if not arr.flags.writeable:
        raise CodecError(f"{what} is read-only")
    if arr.size < need:
        raise CodecError(f"{what} holds {arr.size} B; the run needs {need} B (run_nbytes)")
    return arr


def _torch_impl(run: _Run) -> str:
    return "triton" if run.impl == "triton" else "torch"


@dataclass
class PendingRun:
    """An encoded run on its way into the caller's buffers (`encode_run_start`): a device run's
    device-to-host copies may still be running; `finish` waits for them and writes the chunk
    headers. A C codec run is complete when returned. `checks`: the run's input checks, read by
    `finish` (`lynx_kernels.deferred_checks`)."""

    anchor: PendingChunks | int
    residual: PendingChunks | int
    checks: PendingChecks | None = None

    def finish(self, timeout_s: float = COPY_TIMEOUT_S) -> tuple[int, int]:
        """(anchor bytes, residual bytes) written, once they have landed (TimeoutError if a
        stream's copies take longer than `timeout_s`); CodecError if the run's input is refused
        (the pool's slots, NaN, values fp16 cannot represent): the buffers then hold no valid
        run."""
        written = _landed(self.anchor, timeout_s), _landed(self.residual, timeout_s)
        if self.checks is not None:
            self.checks.finish(timeout_s)
        return written


def _landed(stream: PendingChunks | int, timeout_s: float) -> int:
    return stream if isinstance(stream, int) else sum(stream.finish(timeout_s))


def encode_run_start(pool_layer: torch.Tensor, slots: torch.Tensor, spec: CodecSpec,
                     kind: StreamKind | str, layer: int, chunk_tokens: int, request_tag: int,
                     anchor_out, residual_out, *, impl: str = "auto") -> PendingRun:
    """`encode_run_into` without waiting for a device run's copies into `anchor_out` and
    `residual_out` (`lynx_kernels.chunk_copy`): the buffers are being written until the returned
    run's `finish` has returned, so that the caller can encode the next run meanwhile. The pool
    rows may be reused once this returns (the copies read encoded bytes, not the pool). Slots
    outside the pool and refused values (NaN; target int8: values fp16 scale/zero cannot cover)
    raise their CodecError from `finish` (`lynx_kernels.deferred_checks`: read here, each check
    would make the host wait for a device run), except in the C codec's runs, which raise here."""
    checks = DeferredChecks()
    run = _run(pool_layer, slots, spec, kind, layer, request_tag, len(slots), impl, checks)
    if chunk_tokens <= 0 or (spec.groups_over_tokens(run.kind) and chunk_tokens % spec.group_size):
        raise CodecError(f"chunk_tokens={chunk_tokens} must be positive"
                         + (f" and a multiple of group_size={spec.group_size} when K is grouped "
                            "per channel" if spec.groups_over_tokens(run.kind) else ""))
    sizes = run.sizes(chunk_tokens)
    anchor = _out(anchor_out, sizes.anchor, "anchor_out")
    residual = (None if residual_out is None
                else _out(residual_out, sizes.residual_bound, "residual_out"))
    if run.impl == "cpu":
        return PendingRun(*ops_cpu.encode_run(run.pool, run.slots, spec, run.kind, layer,
                                              chunk_tokens, request_tag, spec_flags(spec),
                                              anchor, residual))
    rows = run.pool.index_select(0, run.slots)
    if rows.device.type == "cuda":
        # The caller may give the pool rows back once this returns (the prefill swaps a streamed
        # room's slots for the prefix cache's copies between layers): the gather must have run.
        wait_for_stream(rows.device)
    # `rows` is this run's own copy: the deferred checks may read it when they fail.
    enc = encode(rows, spec, run.kind, layer=layer, impl=_torch_impl(run), checks=checks)
    return PendingRun(
        start_chunks(enc, chunk_tokens, anchor, stream="anchor", request_tag=request_tag),
        0 if residual is None else start_chunks(enc, chunk_tokens, residual, stream="residual",
                                                request_tag=request_tag),
        checks.start())


def encode_run_into(pool_layer: torch.Tensor, slots: torch.Tensor, spec: CodecSpec,
                    kind: StreamKind | str, layer: int, chunk_tokens: int, request_tag: int,
                    anchor_out, residual_out, *, impl: str = "auto") -> tuple[int, int]:
    """Encode the tokens held in `pool_layer[slots]` (token i in row slots[i]) into Anchor chunks
    written back to back into `anchor_out` and Residual chunks into `residual_out`; returns
    (anchor bytes, residual bytes) written. The pool is only read.

    `residual_out=None` writes the Anchor only (0 Residual bytes): the prefill sends every layer's
    Anchor before it spends time on any Residual (an exact Residual costs ~10x its Anchor), and
    encodes again with both buffers for the Residual; the Anchor bytes come out the same."""
    return encode_run_start(pool_layer, slots, spec, kind, layer, chunk_tokens, request_tag,
                            anchor_out, residual_out, impl=impl).finish()


def _walk(data: np.ndarray, run: _Run, stream: WireStream,
          ranges: list[tuple[int, int]] | None = None) -> list[Chunk]:
    """Every chunk of `data`, each validated and checked against the run; they must tile
    [0, total_tokens) in order (with `ranges`: exactly those token ranges)."""
    view = memoryview(data)
    chunks: list[Chunk] = []
    pos = start = 0
    where = f"layer {run.layer} {run.kind.value.upper()} {stream.name}"
    while pos < len(view):
        if len(view) - pos < HEADER.size:
            raise CodecError(f"{where}: bytes end inside a chunk header at byte {pos} of {len(view)}")
        end = pos + HEADER.size + HEADER.unpack_from(view, pos)[-2]
        if end > len(view):
            raise CodecError(f"{where}: chunk at byte {pos} runs past the end ({end} > {len(view)})")
        chunk = parse_chunk(view[pos:end])
        run.expect(chunk.header, stream, start)
        span = (chunk.header.token_start, chunk.header.token_end)
        if ranges is not None and (len(chunks) >= len(ranges) or ranges[len(chunks)] != span):
            raise CodecError(f"{where}: chunk of tokens {list(span)} has no Anchor chunk of the "
                             "same tokens")
        chunks.append(chunk)
        start, pos = span[1], end
    if start != run.total_tokens:
        raise CodecError(f"{where}: chunks cover tokens [0, {start}) of {run.total_tokens}")
    return chunks


def _device_copy(run: _Run, *buffers: np.ndarray) -> DeviceCopy | None:
    """A device pool's landed bytes, one copy per stream (`wire.DeviceCopy`); None on CPU."""
    return None if run.pool.device.type == "cpu" else DeviceCopy(buffers, run.pool.device)


def apply_anchor_run(anchor_bytes, pool_layer: torch.Tensor, slots: torch.Tensor,
                     spec: CodecSpec, kind: StreamKind | str, layer: int, request_tag: int,
                     total_tokens: int, *, impl: str = "auto") -> None:
    """Write the Anchor reconstruction of a run (bucket midpoints; protected tokens exact) into
    `pool_layer[slots]`, after validating all its chunks."""
    run = _run(pool_layer, slots, spec, kind, layer, request_tag, total_tokens, impl)
    data = _bytes(anchor_bytes, "anchor_bytes")
    if run.impl == "cpu":
        ops_cpu.apply_run(data, None, run.pool, run.slots, spec, run.kind, layer, request_tag,
                          spec_flags(spec))
        return
    enc = assemble(_walk(data, run, WireStream.ANCHOR), device=run.pool.device,
                   copy=_device_copy(run, data))
    run.pool.index_copy_(0, run.slots, decode(enc, "anchor", impl=_torch_impl(run)))


def apply_residual_run(anchor_bytes, residual_bytes, pool_layer: torch.Tensor,
                       slots: torch.Tensor, spec: CodecSpec, kind: StreamKind | str, layer: int,
                       request_tag: int, total_tokens: int, *, impl: str = "auto") -> None:
    """Write the full-precision values of a run (target int8: the INT8 reconstruction; exact: the
    original values bit for bit) into `pool_layer[slots]`, after validating both streams' chunks
    (the Residual's must have the Anchor's token ranges) and decoding every correction."""
    run = _run(pool_layer, slots, spec, kind, layer, request_tag, total_tokens, impl)
    anchor = _bytes(anchor_bytes, "anchor_bytes")
    residual = _bytes(residual_bytes, "residual_bytes")
    if run.impl == "cpu":
        ops_cpu.apply_run(anchor, residual, run.pool, run.slots, spec, run.kind, layer,
                          request_tag, spec_flags(spec))
        return
    anchors = _walk(anchor, run, WireStream.ANCHOR)
    ranges = [(c.header.token_start, c.header.token_end) for c in anchors]
    residuals = _walk(residual, run, WireStream.RESIDUAL, ranges)
    enc = assemble([*anchors, *residuals], device=run.pool.device,
                   copy=_device_copy(run, anchor, residual))
    run.pool.index_copy_(0, run.slots, decode(enc, "full", impl=_torch_impl(run)))
