"""Encode one layer's K or V into Anchor + Residual (`EncodedKV`) and decode it back.

Called by the prefill side (encode, then `lynx_kernels.wire` cuts chunks) and by the decode side
(Anchor chunks -> `decode(stage="anchor")` into the KV pool; Residual chunk -> `refine_` of the same
slots in place). Scale/zero statistics and the rotation are computed here with torch; the per-value
quantize/pack/dequant work goes to `ops_triton` for CUDA tensors and `ops_torch` otherwise.

Quantization: asymmetric min-max to INT8 per group with fp16 zero (= group minimum rounded down)
and fp16 scale (= range / 255 rounded up), so every non-protected value's code lies in 0..255 and the
reconstruction error of the full code is at most scale/2; the Anchor's bucket midpoint is within
scale * 2**(residual_bits - 1). Every step is IEEE fp32 arithmetic in a fixed order (no FMA, the
rotation a pinned FWHT), so the torch, C and Triton implementations agree bit for bit.

Values fp16 scale/zero cannot cover (|x| >= `unrepresentable_limit`, or +-Inf): target "int8"
refuses them; target "exact" zeroes them before the rotation and the statistics, and the exact
Residual carries their bits (its correction escapes). NaN is always refused.

Layout of an `EncodedKV` covering tokens [token_start, token_start + num_tokens) of a run of
total_tokens (hd = heads * head_dim; a/r = anchor/residual bits):
  anchor    uint8 [n, hd * a / 8]     packed top bits (see ops_torch for the bit order)
  zero/scale fp16 [ceil(n / G), hd]   groups over tokens (K per channel; token_start % G == 0)
             fp16 [n, hd / G]          groups over channels (per token)
  protected dtype [p, heads, head_dim] original values of the sink/recent tokens in range
  residual  uint8 [n, hd * r / 8] (target int8) | dtype [n, heads, head_dim] (target exact: the
            original values; `lynx_kernels.wire` codes them as low bits + correction) | None
Tensors are owned by the EncodedKV; `rows` says which rows of each hold a token range (the wire
format cuts chunks with it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from . import ops_torch
from .rotation import is_power_of_two, rotate, unrotate
from .spec import QUANT_BITS, CodecError, CodecSpec, Stage, StreamKind, Target


class CheckSink(Protocol):
    """Where a check that must not make the host wait goes instead of being read at once
    (`deferred_checks.DeferredChecks`, the serving encode's): a device flag and the error it
    means. Named here, not imported: the deferral's copy machinery (chunk_copy) depends on the
    wire format, which depends on this module."""

    def add(self, failed: torch.Tensor, error: Callable[[], CodecError]) -> None: ...

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP16_MAX = 65504.0
IMPLS = ("auto", "torch", "triton")


def _ops(device: torch.device, impl: str) -> ModuleType:
    if impl not in IMPLS:
        raise CodecError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return ops_torch
    from . import ops_triton  # Triton only where it is used: it is slow to import.

    return ops_triton


def protected_positions(total: int, sink: int, recent: int, start: int, end: int) -> torch.Tensor:
    """Absolute positions in [start, end) that are carried at full precision."""
    pos = torch.arange(start, end)
    return pos[(pos < sink) | (pos >= total - recent)]


def protected_count(total: int, sink: int, recent: int, start: int, end: int) -> int:
    """`len(protected_positions(...))` in integer arithmetic (the wire code calls it per chunk)."""
    sinks = max(0, min(end, sink) - start)
    recents = max(0, end - max(total - recent, sink, start))
    return sinks + recents


@dataclass
class EncodedKV:
    """An encoded run of one layer's K or V (see the module docstring for the tensor layout)."""

    spec: CodecSpec
    kind: StreamKind
    layer: int
    dtype: torch.dtype
    num_heads: int
    head_dim: int
    total_tokens: int
    token_start: int
    num_tokens: int
    anchor: torch.Tensor
    zero: torch.Tensor
    scale: torch.Tensor
    protected: torch.Tensor
    residual: torch.Tensor | None

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_tokens

    @property
    def over_tokens(self) -> bool:
        return self.spec.groups_over_tokens(self.kind)

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def nbytes(self, stream: str) -> int:
        """Bytes of the tensors that hold `stream` ("anchor" or "residual") in memory. For the
        Anchor and for the int8 target's Residual that is also the wire's payload (chunk headers
        aside); for the exact target the Residual tensor holds the uncoded values, which the wire
        codes into fewer bytes that depend on the data: `lynx_kernels.wire_nbytes` gives those."""
        if stream == "anchor":
            return sum(t.numel() * t.element_size()
                       for t in (self.anchor, self.zero, self.scale, self.protected))
        if stream == "residual":
            if self.residual is None:
                raise CodecError("this EncodedKV carries no residual")
            return self.residual.numel() * self.residual.element_size()
        raise CodecError(f"stream must be 'anchor' or 'residual', got {stream!r}")

    def rows(self, start: int, end: int) -> tuple[slice, slice, slice]:
        """Which rows hold the tokens [start, end) (absolute positions): of anchor/residual, of
        zero/scale and of protected."""
        if not self.token_start <= start < end <= self.token_end:
            raise CodecError(
                f"token range [{start}, {end}) is not a non-empty part of "
                f"[{self.token_start}, {self.token_end})"
            )
        lo, hi = start - self.token_start, end - self.token_start
        g = self.spec.group_size
        if self.over_tokens:
            if lo % g or (hi % g and end != self.token_end):
                raise CodecError(
                    f"K grouped per channel is cut on multiples of group_size={g} tokens; "
                    f"[{start}, {end}) is not"
                )
            groups = slice(lo // g, -(-hi // g))
        else:
            groups = slice(lo, hi)
        # This run's protected rows are its protected positions in ascending order, so those in
        # [start, end) are one contiguous block of rows.
        counts = (self.total_tokens, self.spec.sink_tokens, self.spec.recent_tokens)
        first = protected_count(*counts, self.token_start, start)
        mine = protected_count(*counts, start, end)
        return slice(lo, hi), groups, slice(first, first + mine)


def parse_kind(kind: StreamKind | str) -> StreamKind:
    """`kind` as a StreamKind ("k" / "v"); anything else is a CodecError."""
    try:
        return StreamKind(kind)
    except ValueError:
        raise CodecError(f"kind must be 'k' or 'v', got {kind!r}") from None


def check_input(x: torch.Tensor, spec: CodecSpec, kind: StreamKind, layer: int) -> None:
    where = f"layer {layer} {kind.value.upper()}"
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"{where}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise CodecError(
            f"{where}: expected rank 3 [tokens, kv_heads, head_dim], got shape {tuple(x.shape)}"
        )
    if x.dtype not in SUPPORTED_DTYPES:
        raise CodecError(f"{where}: dtype {x.dtype} is not one of {SUPPORTED_DTYPES}")
    tokens, heads, head_dim = x.shape
    if tokens == 0 or heads == 0 or head_dim == 0:
        raise CodecError(f"{where}: empty input, shape {tuple(x.shape)}")
    if head_dim % 8:
        raise CodecError(f"{where}: head_dim={head_dim} must be a multiple of 8")
    if not spec.groups_over_tokens(kind) and head_dim % spec.group_size:
        raise CodecError(
            f"{where}: head_dim={head_dim} is not divisible by group_size={spec.group_size} "
            f"(groups run over channels for {'K per token' if kind is StreamKind.K else 'V'})"
        )
    if spec.rotate and not is_power_of_two(head_dim):
        raise CodecError(f"{where}: rotation needs a power-of-two head_dim, got {head_dim}")


def unrepresentable_limit(rotate: bool, head_dim: int) -> float:
    """fp32 |x| from which fp16 scale/zero may fail to cover a value: 65504, or 65504/sqrt(head_dim)
    with the rotation (a rotated value is at most sqrt(head_dim) times the largest of its row)."""
    limit = FP16_MAX / math.sqrt(head_dim) if rotate else FP16_MAX
    return float(torch.tensor(limit, dtype=torch.float32))


def _name_first(x: torch.Tensor, mask: torch.Tensor, kind: StreamKind, layer: int,
                what: str) -> CodecError:
    t, h, d = (int(i) for i in mask.nonzero()[0])
    return CodecError(
        f"layer {layer} {kind.value.upper()}: {what} {x[t, h, d].item()} at token {t}, head {h}, "
        f"channel {d} ({int(mask.sum())} such values in all)"
    )


def quantization_input(x: torch.Tensor, spec: CodecSpec, kind: StreamKind, layer: int,
                       checks: CheckSink | None = None):
    """The fp32 `[tokens, heads * head_dim]` values the quantizer sees (`quantization_values`).
    Raises CodecError for NaN, and for unrepresentable values under target int8. May return a
    view of `x`; never writes it.

    With `checks` (the serving encode, `fused.encode_run_start`) nothing is read back here: each
    refusal becomes a flag on x's device that `checks` reads when the run finishes, raising the
    same CodecError then, so that the host does not wait for the device; without, each check
    reads its result back here."""
    exact = spec.target is Target.EXACT
    if exact:
        nan = functools.partial(_nan_error, x, kind, layer)
        if checks is not None:
            checks.add(torch.isnan(x).any(), nan)
        elif bool(torch.isnan(x).any()):
            raise nan()
    x32 = quantization_values(x, spec)
    if not exact:
        low, high = torch.aminmax(x32)
        if checks is not None:
            checks.add(~((-low < FP16_MAX) & (high < FP16_MAX)),
                       functools.partial(_fp16_range_error, x, low, high, kind, layer))
        elif not (-float(low) < FP16_MAX and float(high) < FP16_MAX):
            raise _fp16_range_error(x, low, high, kind, layer)
    return x32


def quantization_values(x: torch.Tensor, spec: CodecSpec) -> torch.Tensor:
    """`x` as fp32 `[tokens, heads * head_dim]` (target exact: its unrepresentable values zeroed,
    and NaN, which `quantization_input` refuses), rotated if `spec.rotate`; without the checks
    (`exact_parts`: an exact run's values, which its encode checked)."""
    tokens, heads, head_dim = x.shape
    x32 = x.to(torch.float32)
    if spec.target is Target.EXACT:
        # NaN fails the comparison too: a refused run's statistics stay finite until its checks
        # are read.
        x32 = torch.where(x32.abs() < unrepresentable_limit(spec.rotate, head_dim), x32, 0.0)
    if spec.rotate:
        x32 = rotate(x32, spec.rotation_seed)
    return x32.reshape(tokens, heads * head_dim)


def _nan_error(x: torch.Tensor, kind: StreamKind, layer: int) -> CodecError:
    return _name_first(x, torch.isnan(x), kind, layer, "NaN value")


def _fp16_range_error(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, kind: StreamKind,
                      layer: int) -> CodecError:
    """Why target int8 refuses `x`, whose rotated extremes are `low`, `high`: a non-finite value
    makes them non-finite (the rotation has no zero entry), so the costly per-value finiteness
    check only runs to name the culprit."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        return _name_first(x, ~finite, kind, layer, "non-finite value")
    return CodecError(
        f"layer {layer} {kind.value.upper()}: |value| up to {max(-float(low), float(high)):g} is "
        f"beyond what fp16 scale/zero can represent ({FP16_MAX:g}); target 'exact' carries such "
        "values"
    )


def _group_stats(x32: torch.Tensor, spec: CodecSpec, over_tokens: bool):
    """fp16 (zero, scale) per group for `[n, hd]` values; protected rows are left out when groups
    span tokens (a sink token's outliers would otherwise widen every group it belongs to)."""
    n, hd = x32.shape
    g = spec.group_size
    if over_tokens:
        groups, full = -(-n // g), n // g
        lo = torch.empty((groups, hd), dtype=torch.float32, device=x32.device)
        hi = torch.empty_like(lo)
        if full:
            whole = x32[: full * g].view(full, g, hd)
            torch.amin(whole, dim=1, out=lo[:full])
            torch.amax(whole, dim=1, out=hi[:full])
        # The protected tokens are [0, sink) and [n - recent, n), so a group's other tokens are
        # one range; only groups holding a protected token, and the partial tail, need it (the
        # others were reduced over all their rows above).
        first_kept, end_kept = spec.sink_tokens, n - spec.recent_tokens
        for i in range(groups):
            start, end = i * g, min(n, (i + 1) * g)
            if i < full and first_kept <= start and end <= end_kept:
                continue
            lo_row = max(start, first_kept)
            kept = x32[lo_row: max(lo_row, min(end, end_kept))]
            if len(kept):
                torch.amin(kept, dim=0, out=lo[i])
                torch.amax(kept, dim=0, out=hi[i])
            else:  # every token of the group is protected
                lo[i], hi[i] = 0.0, 0.0
    else:
        grouped = x32.view(n, hd // g, g)
        lo, hi = grouped.amin(dim=-1), grouped.amax(dim=-1)
    # Rotated exact-target values may exceed fp16 by fp32 rounding; the clamp keeps scale/zero
    # finite (codes then clamp, and the exact Residual's correction absorbs it). Adding +0 turns
    # -0 into +0: which zero a min/max returns is up to the implementation, the bytes must not be.
    lo = lo.clamp(-FP16_MAX, FP16_MAX) + 0.0
    hi = hi.clamp(-FP16_MAX, FP16_MAX) + 0.0
    zero = lo.to(torch.float16)
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -torch.inf)),
                       zero)
    span = hi - zero.float()
    scale = (span / (2**QUANT_BITS - 1)).to(torch.float16)
    scale = torch.where(scale.float() * (2**QUANT_BITS - 1) < span,
                        torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    return zero, scale


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """fp32 1/scale per group (0 where the scale is 0: a constant group quantizes to code 0)."""
    scale32 = scale.float()
    return torch.where(scale32 > 0, 1.0 / scale32, torch.zeros_like(scale32))


def encode(x: torch.Tensor, spec: CodecSpec, kind: str = "k", *, layer: int = 0,
           impl: str = "auto", checks: CheckSink | None = None) -> EncodedKV:
    """Encode `[tokens, kv_heads, head_dim]` (bf16/fp16/fp32, CPU or CUDA) into Anchor + Residual.

    `x` is only read; the result owns fresh tensors on x's device. `checks`: refuse NaN and
    unrepresentable values when `checks` is read instead of now (`quantization_input`); `x` must
    then stay unchanged until it has been.
    """
    kind = parse_kind(kind)
    check_input(x, spec, kind, layer)
    tokens, heads, head_dim = x.shape
    x32 = quantization_input(x, spec, kind, layer, checks)
    over_tokens = spec.groups_over_tokens(kind)
    protected = protected_positions(tokens, spec.sink_tokens, spec.recent_tokens, 0, tokens)
    zero, scale = _group_stats(x32, spec, over_tokens)
    with_residual_bits = spec.target is Target.INT8
    anchor, residual = _ops(x.device, impl).encode_packed(
        x32, zero.float(), inverse_scale(scale), spec.group_size, over_tokens, spec.anchor_bits,
        with_residual_bits,
    )
    if not with_residual_bits:
        residual = x.contiguous().clone()
    return EncodedKV(
        spec=spec, kind=kind, layer=layer, dtype=x.dtype, num_heads=heads, head_dim=head_dim,
        total_tokens=tokens, token_start=0, num_tokens=tokens, anchor=anchor, zero=zero,
        scale=scale, protected=x[protected.to(x.device)].clone(), residual=residual,
    )


def reconstruct(enc: EncodedKV, low_bits: torch.Tensor | None, impl: str = "auto") -> torch.Tensor:
    """The INT8 reconstruction `[num_tokens, heads, head_dim]` in enc.dtype of every token
    (protected ones included, unreplaced): bucket midpoints when `low_bits` is None, else the full
    codes (the packed low bits `[n, hd * residual_bits / 8]`)."""
    spec = enc.spec
    ops = _ops(enc.device, impl)
    hd = enc.num_heads * enc.head_dim
    args = (enc.zero.float(), enc.scale.float(), hd, spec.group_size, enc.over_tokens,
            spec.anchor_bits)
    if low_bits is None:
        values32 = ops.dequant_anchor(enc.anchor, *args)
    else:
        values32 = ops.dequant_full(enc.anchor, low_bits, *args)
    values32 = values32.view(enc.num_tokens, enc.num_heads, enc.head_dim)
    if spec.rotate:
        values32 = unrotate(values32, spec.rotation_seed)
    return values32.to(enc.dtype)


def exact_parts(enc: EncodedKV, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(packed low bits, INT8 reconstruction) of a target-exact run whose `residual` holds the
    original values: what the exact Residual sends and what its correction is relative to. The
    values are not checked again: `encode` did."""
    spec = enc.spec
    x32 = quantization_values(enc.residual, spec)
    _, low = _ops(enc.device, impl).encode_packed(
        x32, enc.zero.float(), inverse_scale(enc.scale), spec.group_size, enc.over_tokens,
        spec.anchor_bits, True,
    )
    return low, reconstruct(enc, low, impl)


def decode(enc: EncodedKV, stage: str = "anchor", *, impl: str = "auto",
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Reconstruct `[num_tokens, kv_heads, head_dim]` in the original dtype.

    stage "anchor": bucket midpoints (needs only the Anchor); "full": the target precision (needs
    the Residual; bit-identical to the input for target "exact"). With `out`, the result is written
    into it (which must match shape, dtype and device) and `out` is returned.
    """
    try:
        stage = Stage(stage)
    except ValueError:
        raise CodecError(f"stage must be 'anchor' or 'full', got {stage!r}") from None
    shape = (enc.num_tokens, enc.num_heads, enc.head_dim)
    if out is not None and (tuple(out.shape) != shape or out.dtype != enc.dtype
                            or out.device != enc.device):
        raise CodecError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; "
            f"expected {shape} {enc.dtype} on {enc.device}"
        )
    if stage is Stage.FULL and enc.residual is None:
        raise CodecError(
            f"layer {enc.layer} {enc.kind.value.upper()} tokens [{enc.token_start}, "
            f"{enc.token_end}): full decode needs the residual, which has not been attached"
        )
    spec = enc.spec
    exact = stage is Stage.FULL and spec.target is Target.EXACT
    if exact:
        values = enc.residual.view(shape)
    else:
        values = reconstruct(enc, enc.residual if stage is Stage.FULL else None, impl)
    if out is None:
        # The exact Residual is the EncodedKV's own memory: the caller gets a copy of it.
        out = values.clone() if exact else values
    else:
        out.copy_(values)
    positions = protected_positions(enc.total_tokens, spec.sink_tokens, spec.recent_tokens,
                                    enc.token_start, enc.token_end)
    if len(positions):
        out[(positions - enc.token_start).to(out.device)] = enc.protected
    return out


def refine_(target: torch.Tensor, enc: EncodedKV, *, impl: str = "auto") -> torch.Tensor:
    """Overwrite an Anchor-dequantized `target` with the full-precision values, in place.

    The decode side calls this on its KV pool slots once the Residual has been attached to `enc`;
    `target` must be exactly the tensor (or a view of the slots) `decode(stage="anchor")` filled.
    """
    return decode(enc, Stage.FULL, impl=impl, out=target)
