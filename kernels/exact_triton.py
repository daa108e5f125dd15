"""Triton kernels of the exact Residual's section coder (format v2, see `lynx_kernels.exact`): the
same contract and bytes as `exact.encode_sections` / `exact.decode_sections`, one program per
block of 256 values.

`wire.section_coder` hands CUDA tensors here; the test suite runs these
kernels on CPU under `TRITON_INTERPRET=1` against the torch reference, byte for byte and error for
error. Format v2 needs no sequential pass: a block's record starts at the prefix sum of the
record lengths before it (`rec_len`), its L field of value i at the prefix sum of the k's before
i (both sides know every k from the classes), its U field at the prefix sum of the unary lengths
(the encoder knows them; the decoder finds value i's code as the one ending at the block's i-th
zero bit of the U area, a prefix sum of zero bits) and its E field at the prefix sum of the
escapes. So each program computes its block's positions with `tl.cumsum` and nothing crosses
blocks but the record offsets (one torch `cumsum` between the two encode kernels).

Encode: `_record_bits` sizes each block's record, then `_write_records` ORs each value's three
fields into 32-bit words of the records (`atomic_or`: a word may hold fields of two values, or of
two blocks' records, whose bits are disjoint). The k tables come from `exact.choose_k`, the
reference's own torch code (a histogram and an argmin per chunk).
Decode: `_decode_records` finds each block's unary codes (the U area scanned in tiles, each zero
bit's rank in the block stored to a scratch row and read back after a barrier), reads the L and E
fields, rebuilds the values and checks everything the reference checks; a block that fails stores
the index of the first failed check in `exact.CORRUPTIONS`, and the smallest index over all blocks
is raised, the reference's message. The caller writes nothing before the whole decode is checked.

Triton is imported with this module, which `wire.section_coder` imports on its first CUDA call.
`data_len` is not specialized (`do_not_specialize`): its divisibility by 16 varies with the data
and would cost a compile per variant on a serving process. scripts/gpu_check_compile.py compiles
every launch of these kernels for sm_80 and sm_90 (results/gpu_compile.json).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import exact
from .exact import BLOCK, ESCAPE_Q, NUM_CLASSES, DtypeCoding, Section

# U area of a block: at most BLOCK codes of ESCAPE_Q + 1 bits, scanned in tiles of _TILE bits.
_TILE = 1024
_U_TILES = -(-BLOCK * (ESCAPE_Q + 1) // _TILE)
_NO_ERROR = len(exact.CORRUPTIONS)


def _blocks_of(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of 256 values (chunks' values concatenated, each chunk's last block partial):
    (first value's index, values, chunk index), int64 on `device`."""
    n = np.asarray(counts, dtype=np.int64)
    per_chunk = -(-n // BLOCK)
    chunk = np.repeat(np.arange(len(n)), per_chunk)
    nth = np.arange(int(per_chunk.sum())) - np.repeat(np.cumsum(per_chunk) - per_chunk, per_chunk)
    first = np.repeat(np.cumsum(n) - n, per_chunk) + nth * BLOCK
    size = np.minimum(BLOCK, n[chunk] - nth * BLOCK)
    return tuple(torch.from_numpy(v).to(device) for v in (first, size, chunk))


def _k_values(k_nib: torch.Tensor, coding: DtypeCoding) -> torch.Tensor:
    """k per (chunk, class), int64 `[chunks * 16]`."""
    return (k_nib.to(torch.int64) + coding.k_base).reshape(-1).contiguous()


@triton.jit
def _fields(zz_ptr, cls_ptr, k_ptr, first_ptr, size_ptr, chunk_ptr, blk,
            BLOCK: tl.constexpr, ESC_Q: tl.constexpr, NCLS: tl.constexpr):
    """One block's values: (in block, k, unary quotient, escaped, zz), 0 past its end."""
    i = tl.arange(0, BLOCK)
    first = tl.load(first_ptr + blk)
    m = i < tl.load(size_ptr + blk)
    zz = tl.load(zz_ptr + first + i, mask=m, other=0)
    cls = tl.load(cls_ptr + first + i, mask=m, other=0)
    k = tl.load(k_ptr + tl.load(chunk_ptr + blk) * NCLS + cls, mask=m, other=0)
    q = zz >> k
    esc = m & (q >= ESC_Q)
    unary = tl.where(esc, ESC_Q, q)
    return m, k, unary, esc, zz


@triton.jit
def _record_bits(zz_ptr, cls_ptr, k_ptr, first_ptr, size_ptr, chunk_ptr, rec_bytes_ptr,
                 WIDTH: tl.constexpr, BLOCK: tl.constexpr, ESC_Q: tl.constexpr,
                 NCLS: tl.constexpr):
    blk = tl.program_id(0)
    m, k, unary, esc, _ = _fields(zz_ptr, cls_ptr, k_ptr, first_ptr, size_ptr, chunk_ptr, blk,
                                  BLOCK, ESC_Q, NCLS)
    bits = tl.sum(tl.where(m, k + unary + 1, 0) + tl.where(esc, WIDTH, 0), axis=0)
    tl.store(rec_bytes_ptr + blk, (bits + 7) // 8)


@triton.jit
def _or_field(words_ptr, pos, val, m):
    """OR `val` (< 2**32) into the LSB-first bit stream of int32 words at bit `pos`."""
    shifted = val << (pos & 31)
    lo = shifted & 0xFFFFFFFF
    hi = shifted >> 32
    tl.atomic_or(words_ptr + (pos >> 5), lo.to(tl.int32), mask=m & (lo != 0))
    tl.atomic_or(words_ptr + (pos >> 5) + 1, hi.to(tl.int32), mask=m & (hi != 0))


@triton.jit
def _write_records(zz_ptr, cls_ptr, k_ptr, first_ptr, size_ptr, chunk_ptr, x_ptr, rec_start_ptr,
                   words_ptr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, ESC_Q: tl.constexpr,
                   NCLS: tl.constexpr):
    blk = tl.program_id(0)
    m, k, unary, esc, zz = _fields(zz_ptr, cls_ptr, k_ptr, first_ptr, size_ptr, chunk_ptr, blk,
                                   BLOCK, ESC_Q, NCLS)
    base = 8 * tl.load(rec_start_ptr + blk)
    len_l = tl.where(m, k, 0)
    len_u = tl.where(m, unary + 1, 0)
    len_e = tl.where(esc, WIDTH, 0)
    end_l = tl.sum(len_l, axis=0)
    end_u = end_l + tl.sum(len_u, axis=0)
    one = tl.full([BLOCK], 1, tl.int64)
    low = tl.where(esc, 0, zz & ((one << k) - 1))
    _or_field(words_ptr, base + tl.cumsum(len_l, axis=0) - len_l, low, m)
    _or_field(words_ptr, base + end_l + tl.cumsum(len_u, axis=0) - len_u, (one << unary) - 1, m)
    first = tl.load(first_ptr + blk)
    x = tl.load(x_ptr + first + tl.arange(0, BLOCK), mask=esc, other=0)
    _or_field(words_ptr, base + end_u + tl.cumsum(len_e, axis=0) - len_e, x, esc)


def encode_sections(zz: torch.Tensor, cls: torch.Tensor, x_bits: torch.Tensor,
                    counts: list[int], coding: DtypeCoding) -> list[Section]:
    """`exact.encode_sections` by the Triton kernels: the same sections, byte for byte."""
    device = zz.device
    nchunks = len(counts)
    counts_t = torch.tensor(counts, dtype=torch.int64).to(device)
    n = sum(counts)
    chunk_of = torch.repeat_interleave(torch.arange(nchunks, device=device), counts_t,
                                       output_size=n)
    starts = torch.cumsum(counts_t, 0) - counts_t
    local = torch.arange(n, device=device) - starts[chunk_of]
    k_nib = exact.choose_k(zz, cls, chunk_of, local, nchunks, coding)
    k = _k_values(k_nib, coding)
    first, size, chunk = _blocks_of(counts, device)
    nblk = len(first)
    zz, cls, x_bits = zz.contiguous(), cls.contiguous(), x_bits.contiguous()
    rec_bytes = torch.zeros(nblk, dtype=torch.int64, device=device)
    consts = {"WIDTH": coding.width, "BLOCK": BLOCK, "ESC_Q": ESCAPE_Q, "NCLS": NUM_CLASSES}
    if nblk:
        _record_bits[(nblk,)](zz, cls, k, first, size, chunk, rec_bytes, **consts)
    ends = torch.cumsum(rec_bytes, 0)
    # The run's one host sync: the records' offsets size their buffer here and cut it into the
    # chunks' sections in `pack_sections` (which would otherwise sync again for them).
    ends_host = ends.tolist()
    total = ends_host[-1] if nblk else 0
    words = torch.zeros(total // 4 + 2, dtype=torch.int32, device=device)
    if nblk:
        _write_records[(nblk,)](zz, cls, k, first, size, chunk, x_bits, ends - rec_bytes, words,
                                **consts)
    records = words.view(torch.uint8)[:total]
    return exact.pack_sections(k_nib, rec_bytes, records,
                               [exact.num_blocks(c) for c in counts], ends_host)


@triton.jit
def _read_bits(data_ptr, data_len, pos, nbits, m):
    """`nbits` (<= 32) bits at bit positions `pos` (LSB first); bytes past `data_len` read 0."""
    byte = pos >> 3
    word = tl.zeros(pos.shape, tl.int64)
    for j in tl.static_range(5):
        b = tl.load(data_ptr + byte + j, mask=m & (byte + j < data_len), other=0)
        word |= b.to(tl.int64) << (8 * j)
    one = tl.full(pos.shape, 1, tl.int64)
    return (word >> (pos & 7)) & ((one << nbits) - 1)


@triton.jit
def _first_error(err, failed, code: tl.constexpr):
    return tl.where(failed & (err > code), code, err)


@triton.jit(do_not_specialize=["data_len"])
def _decode_records(data_ptr, data_len, rec_end_ptr, rec_len_ptr, cls_ptr, r_ptr, k_ptr,
                    first_ptr, size_ptr, chunk_ptr, zpos_ptr, out_ptr, err_ptr,
                    WIDTH: tl.constexpr, MAG_MASK: tl.constexpr, NAN_ABOVE: tl.constexpr,
                    BLOCK: tl.constexpr, ESC_Q: tl.constexpr, NCLS: tl.constexpr,
                    TILE: tl.constexpr, U_TILES: tl.constexpr, NO_ERROR: tl.constexpr):
    blk = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    first = tl.load(first_ptr + blk)
    n = tl.load(size_ptr + blk)
    m = i < n
    cls = tl.load(cls_ptr + first + i, mask=m, other=0)
    k = tl.load(k_ptr + tl.load(chunk_ptr + blk) * NCLS + cls, mask=m, other=0)
    end = 8 * tl.load(rec_end_ptr + blk)
    start = end - 8 * tl.load(rec_len_ptr + blk)
    end_l = tl.sum(k, axis=0)
    u0 = start + end_l
    err = tl.full([], NO_ERROR, tl.int32)
    err = _first_error(err, u0 > end, 0)
    low = _read_bits(data_ptr, data_len, start + tl.cumsum(k, axis=0) - k, k, m)
    # Value i's unary code ends at the U area's i-th zero bit: store each zero's position at its
    # rank, in this block's scratch row, for the lanes to read back.
    found = tl.zeros([], tl.int64)
    for t in tl.static_range(U_TILES):
        p = u0 + t * TILE + tl.arange(0, TILE)
        inside = p < end
        b = tl.load(data_ptr + (p >> 3), mask=inside & ((p >> 3) < data_len), other=255)
        zero = inside & (((b.to(tl.int64) >> (p & 7)) & 1) == 0)
        z = zero.to(tl.int64)
        rank = found + tl.cumsum(z, axis=0) - 1
        tl.store(zpos_ptr + blk * BLOCK + rank, p, mask=zero & (rank < n))
        found += tl.sum(z, axis=0)
    tl.debug_barrier()
    # Fewer zeros than values: the record ends inside a unary code (the scan reached its end), or
    # a code has more than ESC_Q one-bits before its zero (it did not).
    short = found < n
    err = _first_error(err, short & (u0 + U_TILES * TILE >= end), 2)
    err = _first_error(err, short, 3)
    have = m & (i < found)
    z_pos = tl.load(zpos_ptr + blk * BLOCK + i, mask=have, other=0)
    prev = tl.load(zpos_ptr + blk * BLOCK + i - 1, mask=have & (i > 0), other=0)
    prev = tl.where(i == 0, u0 - 1, prev)
    q = tl.where(have, z_pos - prev - 1, 0)
    err = _first_error(err, tl.max((q > ESC_Q).to(tl.int32), axis=0) > 0, 3)
    esc = have & (q == ESC_Q)
    err = _first_error(err, tl.max((esc & (low != 0)).to(tl.int32), axis=0) > 0, 4)
    u_end = u0 + tl.sum(tl.where(have, q + 1, 0), axis=0)
    len_e = tl.where(esc, WIDTH, 0)
    e_end = u_end + tl.sum(len_e, axis=0)
    err = _first_error(err, (e_end > end) | (e_end <= end - 8), 5)
    # The record's last bits, after its E area, must be zero (read only where there are 1-7).
    pad_at = tl.zeros([1], tl.int64) + e_end
    pad = tl.where((pad_at < end) & (pad_at > end - 8), end - pad_at, 0)
    pad_bits = _read_bits(data_ptr, data_len, pad_at, pad, pad > 0)
    err = _first_error(err, tl.max(pad_bits, axis=0) != 0, 6)
    zz = (q << k) | low
    c = (zz >> 1) ^ -(zz & 1)
    r = tl.load(r_ptr + first + i, mask=m, other=0)
    half = tl.full([], 1, tl.int64) << (WIDTH - 1)  # 2**31 is no int32 constant
    o = tl.where((r >> (WIDTH - 1)) == 1, -1 - (r & MAG_MASK), r) + c
    out_of_range = have & ~esc & ((o < -half) | (o >= half))
    err = _first_error(err, tl.max(out_of_range.to(tl.int32), axis=0) > 0, 7)
    o = tl.minimum(tl.maximum(o, -half), half - 1)
    x = tl.where(o >= 0, o, half | (-1 - o))
    e_pos = u_end + tl.cumsum(len_e, axis=0) - len_e
    x = tl.where(esc, _read_bits(data_ptr, data_len, e_pos, WIDTH, esc), x)
    err = _first_error(err, tl.max((m & ((x & MAG_MASK) > NAN_ABOVE)).to(tl.int32), axis=0) > 0,
                       8)
    tl.store(out_ptr + first + i, x, mask=m)
    tl.store(err_ptr + blk, err)


def decode_sections(sections: list[Section], cls: torch.Tensor, r_bits: torch.Tensor,
                    counts: list[int], coding: DtypeCoding) -> torch.Tensor:
    """`exact.decode_sections` by the Triton kernel: the same values, and a CodecError with the
    reference's message for a corrupt section (raised before anything is returned)."""
    device = cls.device
    n = sum(counts)
    if not n:
        return torch.zeros(0, dtype=torch.int64, device=device)
    k_nib = exact.k_nibbles(sections)
    rec_len = exact.record_lengths(sections)
    data = torch.cat([s.records for s in sections]).contiguous()
    first, size, chunk = _blocks_of(counts, device)
    nblk = len(first)
    out = torch.empty(n, dtype=torch.int64, device=device)
    zpos = torch.empty(nblk * BLOCK, dtype=torch.int64, device=device)
    err = torch.empty(nblk, dtype=torch.int32, device=device)
    _decode_records[(nblk,)](
        data, data.numel(), torch.cumsum(rec_len, 0), rec_len, cls.contiguous(),
        r_bits.contiguous(), _k_values(k_nib, coding), first, size, chunk, zpos, out, err,
        WIDTH=coding.width, MAG_MASK=coding.magnitude_mask, NAN_ABOVE=coding.nan_above,
        BLOCK=BLOCK, ESC_Q=ESCAPE_Q, NCLS=NUM_CLASSES, TILE=_TILE, U_TILES=_U_TILES,
        NO_ERROR=_NO_ERROR)
    first_error = int(err.min())
    if first_error != _NO_ERROR:
        raise exact.corrupt(exact.CORRUPTIONS[first_error])
    return out
