"""Torch reference for the codec's per-value work: quantize + split + bit-pack, and the two dequants.

`lynx_kernels.codec` calls these on CPU (and wherever Triton is unavailable); the Triton kernels in
`lynx_kernels.ops_triton` implement the same three functions with the same contract and are tested
against these. All functions take a run of `n` tokens flattened to `[n, hd]` (hd = heads x
head_dim), per-group fp32 `zero`/`scale` laid out as `lynx_kernels.codec` describes, and return new
tensors (they never write into their inputs).

Bit packing: values are taken in row-major order, 8 at a time; 8 values of `bits` bits become
`bits` bytes, value j of the 8 occupying bits [bits*j, bits*j + bits) of the little-endian word.
hd is a multiple of 8, so every token starts on a byte boundary and a token range is a byte range.
"""

from __future__ import annotations

import torch

from .spec import QUANT_BITS


def expand_groups(per_group: torch.Tensor, n: int, hd: int, group_size: int, over_tokens: bool):
    """Broadcast a per-group tensor to one entry per value, `[n, hd]`."""
    if over_tokens:
        groups = per_group.view(-1, 1, hd).expand(-1, group_size, hd).reshape(-1, hd)
        return groups[:n]
    return per_group.view(n, hd // group_size, 1).expand(n, hd // group_size, group_size).reshape(
        n, hd
    )


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack `[n, hd]` uint8 values (each < 2**bits) into `[n, hd * bits // 8]` bytes."""
    n, hd = values.shape
    if 8 % bits == 0 and bits < 8:
        # Whole values per byte: read the byte's values as one little-endian word (value k in its
        # bits [8k, 8k + bits)) and shift each into place, bits [bits*k, ...) of the low byte;
        # whatever the shifts leave above the low byte is cut by the uint8 conversion.
        per_byte = 8 // bits
        words = values.contiguous().view({2: torch.int16, 4: torch.int32}[per_byte])
        packed = words.clone()
        for k in range(1, per_byte):
            packed |= words >> (k * (8 - bits))
        return packed.to(torch.uint8).view(n, hd * bits // 8)
    shifts = torch.arange(8, device=values.device, dtype=torch.int64) * bits
    words = (values.view(n, hd // 8, 8).to(torch.int64) << shifts).sum(dim=-1)
    byte_shifts = torch.arange(bits, device=values.device, dtype=torch.int64) * 8
    packed = (words.unsqueeze(-1) >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).view(n, hd * bits // 8)


def unpack_bits(packed: torch.Tensor, bits: int, hd: int) -> torch.Tensor:
    """Inverse of `pack_bits`: `[n, hd * bits // 8]` bytes to `[n, hd]` values (uint8 or int64)."""
    n = packed.shape[0]
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        # One small op per lane, then interleave: faster than a broadcast shift over all lanes.
        lanes = [(packed >> shift) & mask for shift in range(0, 8, bits)]
        return torch.stack(lanes, dim=-1).view(n, hd)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(n, hd // 8, bits).to(torch.int64) << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((words.unsqueeze(-1) >> shifts) & mask).view(n, hd)


def group_pieces(n: int, hd: int, group_size: int, over_tokens: bool):
    """Cover `[n, hd]` values with views under which the per-group tensors broadcast, so no
    per-value copy of scale/zero is made: (rows, values shape, groups, per-group shape) each."""
    if not over_tokens:
        return [(slice(0, n), (n, hd // group_size, group_size), slice(0, n),
                 (n, hd // group_size, 1))]
    full = n // group_size
    pieces = []
    if full:
        pieces.append((slice(0, full * group_size), (full, group_size, hd), slice(0, full),
                       (full, 1, hd)))
    if n % group_size:
        pieces.append((slice(full * group_size, n), (n - full * group_size, hd),
                       slice(full, full + 1), (1, hd)))
    return pieces


def quantize_codes(x: torch.Tensor, zero: torch.Tensor, inv_scale: torch.Tensor, group_size: int,
                   over_tokens: bool) -> torch.Tensor:
    """INT8 codes `floor((x - zero) * inv_scale + 0.5)` in 0..255, as uint8 `[n, hd]`.

    The clamp only bites for protected tokens, which are excluded from the group statistics and
    carried at full precision anyway; for every other value the statistics guarantee 0..255.
    Clamping before the uint8 conversion (which truncates) is the same as flooring first: the
    clamped values are >= 0, where truncation is floor.
    """
    n, hd = x.shape
    x = x.to(torch.float32)
    # Through int16: fp32 -> int16 -> uint8 is the same truncation, and much faster on CPU.
    codes = torch.empty((n, hd), dtype=torch.int16, device=x.device)
    for rows, shape, groups, gshape in group_pieces(n, hd, group_size, over_tokens):
        t = x[rows].view(shape) - zero[groups].view(gshape)
        t.mul_(inv_scale[groups].view(gshape)).add_(0.5).clamp_(0, 2**QUANT_BITS - 1)
        codes[rows].view(shape).copy_(t)
    return codes.to(torch.uint8)


def _scale_add_zero(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group_size: int,
                    over_tokens: bool) -> torch.Tensor:
    """fp32 `scale * q + zero` per group for fp32 `[n, hd]` q (two roundings, as it always was)."""
    n, hd = q.shape
    values = torch.empty_like(q)
    for rows, shape, groups, gshape in group_pieces(n, hd, group_size, over_tokens):
        out = values[rows].view(shape)
        torch.mul(scale[groups].view(gshape), q[rows].view(shape), out=out)
        out.add_(zero[groups].view(gshape))
    return values


def encode_packed(x: torch.Tensor, zero: torch.Tensor, inv_scale: torch.Tensor, group_size: int,
                  over_tokens: bool, anchor_bits: int, with_residual: bool):
    """Quantize `[n, hd]` and split each code: returns (anchor bytes, residual bytes or None)."""
    codes = quantize_codes(x, zero, inv_scale, group_size, over_tokens)
    residual_bits = QUANT_BITS - anchor_bits
    anchor = pack_bits(codes >> residual_bits, anchor_bits)
    if not with_residual:
        return anchor, None
    return anchor, pack_bits(codes & ((1 << residual_bits) - 1), residual_bits)


def dequant_anchor(anchor: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, hd: int,
                   group_size: int, over_tokens: bool, anchor_bits: int) -> torch.Tensor:
    """fp32 `[n, hd]`: each value at the midpoint of the bucket of codes its Anchor bits allow."""
    residual_bits = QUANT_BITS - anchor_bits
    mid = (unpack_bits(anchor, anchor_bits, hd) << residual_bits).to(torch.float32)
    mid += ((1 << residual_bits) - 1) / 2
    return _scale_add_zero(mid, zero, scale, group_size, over_tokens)


def dequant_full(anchor: torch.Tensor, residual: torch.Tensor, zero: torch.Tensor,
                 scale: torch.Tensor, hd: int, group_size: int, over_tokens: bool,
                 anchor_bits: int) -> torch.Tensor:
    """fp32 `[n, hd]` from the whole INT8 code (Anchor bits joined with Residual bits)."""
    residual_bits = QUANT_BITS - anchor_bits
    codes = (unpack_bits(anchor, anchor_bits, hd) << residual_bits) | unpack_bits(
        residual, residual_bits, hd
    )
    return _scale_add_zero(codes.to(torch.float32), zero, scale, group_size, over_tokens)
