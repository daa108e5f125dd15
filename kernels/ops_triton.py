"""Triton kernels for the codec's per-value work, same contract as `lynx_kernels.ops_torch`.

`lynx_kernels.codec` uses these for CUDA tensors; the test suite runs them on CPU under
`TRITON_INTERPRET=1` and checks them against the torch reference bit for bit. Every launch passes
`enable_fp_fusion=False`: the reference rounds `scale * code` and `+ zero` separately (and
`(x - zero) * inv + 0.5` step by step), so an FMA would change the bits. Each program handles
BLOCK words of 8 values; a word of 8 `bits`-bit values is `bits` bytes, so packing needs no
cross-program communication. Triton is imported lazily by the caller.

`n_words` is not specialized (`do_not_specialize`): it only bounds a mask, and its divisibility
by 16, which Triton would otherwise compile a variant for, changes with the run's length (a
compile on a serving process's first request of each kind). scripts/gpu_check_compile.py
compiles every launch of these kernels for sm_80 and sm_90 (results/gpu_compile.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .spec import QUANT_BITS

_BLOCK = 128


@triton.jit
def _group_index(idx, HD: tl.constexpr, G: tl.constexpr, OVER_TOKENS: tl.constexpr):
    if OVER_TOKENS:
        return (idx // HD // G) * HD + idx % HD
    else:
        return idx // G


@triton.jit(do_not_specialize=["n_words"])
def _encode_kernel(x_ptr, zero_ptr, inv_ptr, anchor_ptr, resid_ptr, n_words,
                   HD: tl.constexpr, G: tl.constexpr, OVER_TOKENS: tl.constexpr,
                   A_BITS: tl.constexpr, R_BITS: tl.constexpr, WITH_RESIDUAL: tl.constexpr,
                   BLOCK: tl.constexpr):
    w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    m = (w < n_words)[:, None]
    idx = w[:, None] * 8 + j[None, :]
    g = _group_index(idx, HD, G, OVER_TOKENS)
    x = tl.load(x_ptr + idx, mask=m, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + g, mask=m, other=0.0)
    inv = tl.load(inv_ptr + g, mask=m, other=0.0)
    codes = tl.floor((x - z) * inv + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), 255.0).to(tl.int64)
    j64 = j.to(tl.int64)[None, :]
    word = tl.sum((codes >> R_BITS) << (j64 * A_BITS), axis=1)
    out = ((word[:, None] >> (j64 * 8)) & 255).to(tl.uint8)
    tl.store(anchor_ptr + w[:, None] * A_BITS + j[None, :], out, mask=m & (j[None, :] < A_BITS))
    if WITH_RESIDUAL:
        word = tl.sum((codes & ((1 << R_BITS) - 1)) << (j64 * R_BITS), axis=1)
        out = ((word[:, None] >> (j64 * 8)) & 255).to(tl.uint8)
        tl.store(resid_ptr + w[:, None] * R_BITS + j[None, :], out,
                 mask=m & (j[None, :] < R_BITS))


@triton.jit
def _unpack(ptr, w, m, j, BITS: tl.constexpr):
    j64 = j.to(tl.int64)[None, :]
    raw = tl.load(ptr + w[:, None] * BITS + j[None, :], mask=m & (j[None, :] < BITS), other=0)
    word = tl.sum(raw.to(tl.int64) << (j64 * 8), axis=1)
    return (word[:, None] >> (j64 * BITS)) & ((1 << BITS) - 1)


@triton.jit(do_not_specialize=["n_words"])
def _dequant_kernel(anchor_ptr, resid_ptr, zero_ptr, scale_ptr, out_ptr, n_words,
                    HD: tl.constexpr, G: tl.constexpr, OVER_TOKENS: tl.constexpr,
                    A_BITS: tl.constexpr, R_BITS: tl.constexpr, FULL: tl.constexpr,
                    MID: tl.constexpr, BLOCK: tl.constexpr):
    w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    m = (w < n_words)[:, None]
    idx = w[:, None] * 8 + j[None, :]
    g = _group_index(idx, HD, G, OVER_TOKENS)
    top = _unpack(anchor_ptr, w, m, j, A_BITS)
    if FULL:
        codes = ((top << R_BITS) | _unpack(resid_ptr, w, m, j, R_BITS)).to(tl.float32)
    else:
        codes = (top << R_BITS).to(tl.float32) + MID
    z = tl.load(zero_ptr + g, mask=m, other=0.0)
    s = tl.load(scale_ptr + g, mask=m, other=0.0)
    tl.store(out_ptr + idx, z + s * codes, mask=m)


def _grid(n: int, hd: int):
    n_words = n * hd // 8
    return n_words, (triton.cdiv(n_words, _BLOCK),)


def encode_packed(x: torch.Tensor, zero: torch.Tensor, inv_scale: torch.Tensor, group_size: int,
                  over_tokens: bool, anchor_bits: int, with_residual: bool):
    n, hd = x.shape
    residual_bits = QUANT_BITS - anchor_bits
    anchor = torch.empty((n, hd * anchor_bits // 8), dtype=torch.uint8, device=x.device)
    residual = (torch.empty((n, hd * residual_bits // 8), dtype=torch.uint8, device=x.device)
                if with_residual else anchor)
    n_words, grid = _grid(n, hd)
    _encode_kernel[grid](x.contiguous(), zero.contiguous(), inv_scale.contiguous(), anchor,
                         residual, n_words, HD=hd, G=group_size, OVER_TOKENS=over_tokens,
                         A_BITS=anchor_bits, R_BITS=residual_bits, WITH_RESIDUAL=with_residual,
                         BLOCK=_BLOCK, enable_fp_fusion=False)
    return anchor, (residual if with_residual else None)


def _dequant(anchor, residual, zero, scale, hd, group_size, over_tokens, anchor_bits, full):
    n = anchor.shape[0]
    residual_bits = QUANT_BITS - anchor_bits
    out = torch.empty((n, hd), dtype=torch.float32, device=anchor.device)
    n_words, grid = _grid(n, hd)
    _dequant_kernel[grid](anchor.contiguous(), (residual if full else anchor).contiguous(),
                          zero.contiguous(), scale.contiguous(), out, n_words, HD=hd,
                          G=group_size, OVER_TOKENS=over_tokens, A_BITS=anchor_bits,
                          R_BITS=residual_bits, FULL=full,
                          MID=((1 << residual_bits) - 1) / 2, BLOCK=_BLOCK, enable_fp_fusion=False)
    return out


def dequant_anchor(anchor, zero, scale, hd, group_size, over_tokens, anchor_bits):
    return _dequant(anchor, None, zero, scale, hd, group_size, over_tokens, anchor_bits, False)


def dequant_full(anchor, residual, zero, scale, hd, group_size, over_tokens, anchor_bits):
    return _dequant(anchor, residual, zero, scale, hd, group_size, over_tokens, anchor_bits, True)
