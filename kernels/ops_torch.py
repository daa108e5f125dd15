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
    if 8 % bits == 0:
        # Whole values per byte: plain uint8 shifts, several times faster than 64-bit words.
        per_byte = 8 // bits
        lanes = values.view(n, hd // per_byte, per_byte)
        packed = lanes[..., 0].clone()
        for k in range(1, per_byte):
            packed |= lanes[..., k] << (bits * k)
        return packed
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
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        return ((packed.unsqueeze(-1) >> shifts) & mask).view(n, hd)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(n, hd // 8, bits).to(torch.int64) << byte_shifts).sum(dim=-1)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((words.unsqueeze(-1) >> shifts) & mask).view(n, hd)


def quantize_codes(x: torch.Tensor, zero: torch.Tensor, inv_scale: torch.Tensor, group_size: int,
                   over_tokens: bool) -> torch.Tensor:
    """INT8 codes `floor((x - zero) * inv_scale + 0.5)` in 0..255, as uint8 `[n, hd]`.

    The clamp only bites for protected tokens, which are excluded from the group statistics and
    carried at full precision anyway; for every other value the statistics guarantee 0..255.
    """
    n, hd = x.shape
    z = expand_groups(zero, n, hd, group_size, over_tokens)
    inv = expand_groups(inv_scale, n, hd, group_size, over_tokens)
    codes = x.to(torch.float32) - z
    codes.mul_(inv).add_(0.5).floor_()
    return codes.clamp_(0, 2**QUANT_BITS - 1).to(torch.uint8)


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
    n = anchor.shape[0]
    values = expand_groups(scale, n, hd, group_size, over_tokens) * mid
    return values.add_(expand_groups(zero, n, hd, group_size, over_tokens))


def dequant_full(anchor: torch.Tensor, residual: torch.Tensor, zero: torch.Tensor,
                 scale: torch.Tensor, hd: int, group_size: int, over_tokens: bool,
                 anchor_bits: int) -> torch.Tensor:
    """fp32 `[n, hd]` from the whole INT8 code (Anchor bits joined with Residual bits)."""
    residual_bits = QUANT_BITS - anchor_bits
    codes = (unpack_bits(anchor, anchor_bits, hd) << residual_bits) | unpack_bits(
        residual, residual_bits, hd
    )
    n = anchor.shape[0]
    values = expand_groups(scale, n, hd, group_size, over_tokens) * codes.to(torch.float32)
    return values.add_(expand_groups(zero, n, hd, group_size, over_tokens))
