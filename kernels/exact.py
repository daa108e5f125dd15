"""The lossless ("exact") Residual, format v2 "ClassRice-256": torch reference encoder and decoder.

For target "exact" a Residual chunk carries the INT8 low bits (as for target "int8") plus a compact
correction of the INT8 reconstruction. Called by `lynx_kernels.wire` (cutting and assembling
chunks); `lynx_kernels.ops_cpu` implements the same format in C and is tested bit for bit against
this module; `lynx_kernels.exact_triton` implements the section coder in Triton, which
`wire.section_coder` picks for CUDA tensors (everything here is torch, so it would run there too,
as dozens of kernel launches and host syncs per run).

Prediction r of each value (non-protected tokens only): the INT8 reconstruction, fp32
`scale * code` then `+ zero` (two roundings, no FMA), unrotated (`lynx_kernels.rotation`), rounded
to the pool dtype with round-to-nearest-even (fp32 pools: r is the fp32 value itself).
Correction c = ord(x) - ord(r), ord(bits) = bits for sign 0, -1 - (bits & magnitude mask) for
sign 1 (so +0 != -0); zz = zigzag(c) = 2c for c >= 0, -2c - 1 otherwise.
Class of a value = clamp(e_s - e_r + class_offset, 0, 15): e_r the unbiased exponent field of r
(+-0 and subnormals: the field's 0 minus the bias), e_s that of the value's fp16 scale; with
rotation a value mixes its whole head, so e_s is the largest over the groups covering its
(token, head). The class predicts log2|c|; the encoder's table maps it to a Rice parameter k.

Section (after the packed low bits in the Residual payload), per chunk:
  k_table  8 bytes: for class 2i the low nibble of byte i, 2i+1 the high nibble; k = nibble + k_base
  rec_len  uint16 LE per block of 256 values (the chunk's non-protected values in row-major
           [token][head][dim] order; the last block may be partial): its record's byte length
  records  one per block, back to back, each an LSB-first bit stream of three areas, zero-padded
           to a byte: L = for every value the k low bits of zz (an escaped value: k zero bits),
           U = for every value min(zz >> k, 16) one-bits then a zero (16 = escape),
           E = for every escaped value, in value order, the raw bits of x (the dtype's width).
A chunk whose section would make its payload larger than the raw values is sent raw instead
(`wire` flags it), so the stream never exceeds the raw values' bound
(`wire.ChunkHeader.section_sizes`).

The encoder picks each class's k from one histogram of bitlen(zz) per class over every
HIST_STRIDE-th value of the chunk, minimising a cost estimate in integer arithmetic
(`_cost2_table`); ties go to the smaller k. Any k decodes; the rule only has to be the same in
every encoder so their bytes are identical.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .spec import CodecError

BLOCK = 256
ESCAPE_Q = 16
NUM_CLASSES = 16
K_TABLE_BYTES = NUM_CLASSES // 2
_BITLEN_BINS = 40  # bitlen(zz) <= 33 for 32-bit values
# The k table is chosen from the values at chunk indices 0, 7, 14, ...: a histogram of every value
# was a large share of the C encoder's time, and the sample costs +0.1% bytes on SmolLM2. 7 is
# coprime with head_dim, so the sample visits every channel.
HIST_STRIDE = 7


@dataclass(frozen=True)
class DtypeCoding:
    """How values of one pool dtype are coded.

    class_offset: e_s - e_r + class_offset is the class. 9 for every dtype: on SmolLM2 K/V the
        offsets 7..12 code to the same size within 0.01 bit/value for bf16 and fp16 (the classes
        only have to separate the e_s - e_r that occur; the per-chunk k table absorbs a wider
        mantissa's larger corrections).
    k_base: added to each 4-bit k-table entry. fp32 corrections are ~16 bits wider than bf16's,
        so fp32 uses k in 8..23 instead of 0..15 (18.7 instead of 24.1 bits/value on SmolLM2 K).
    """

    width: int
    exp_shift: int
    exp_mask: int
    exp_bias: int
    class_offset: int
    k_base: int

    @property
    def nan_above(self) -> int:
        """Magnitude bits above this are NaN."""
        return self.exp_mask << self.exp_shift

    @property
    def magnitude_mask(self) -> int:
        return (1 << (self.width - 1)) - 1


CODINGS = {
    torch.bfloat16: DtypeCoding(16, 7, 0xFF, 127, 9, 0),
    torch.float16: DtypeCoding(16, 10, 0x1F, 15, 9, 0),
    torch.float32: DtypeCoding(32, 23, 0xFF, 127, 9, 8),
}
_INT_VIEW = {16: torch.int16, 32: torch.int32}


def value_bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor as non-negative int64."""
    width = CODINGS[x.dtype].width
    return x.contiguous().view(_INT_VIEW[width]).to(torch.int64) & ((1 << width) - 1)


def bits_to_values(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    width = CODINGS[dtype].width
    signed = torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)
    return signed.to(_INT_VIEW[width]).view(dtype)


def ordinal(bits: torch.Tensor, coding: DtypeCoding) -> torch.Tensor:
    sign = bits >> (coding.width - 1)
    return torch.where(sign == 1, -1 - (bits & coding.magnitude_mask), bits)


def from_ordinal(o: torch.Tensor, coding: DtypeCoding) -> torch.Tensor:
    return torch.where(o >= 0, o, (1 << (coding.width - 1)) | (-1 - o))


def exponent(bits: torch.Tensor, coding: DtypeCoding) -> torch.Tensor:
    return ((bits >> coding.exp_shift) & coding.exp_mask) - coding.exp_bias


def scale_exponents(scale: torch.Tensor, num_tokens: int, heads: int, head_dim: int,
                    group_size: int, over_tokens: bool, rotate: bool) -> torch.Tensor:
    """e_s per value, int64 `[num_tokens, heads, head_dim]` (see the module docstring)."""
    e = (scale.contiguous().view(torch.int16).to(torch.int64) >> 10 & 0x1F) - 15
    if over_tokens:  # [groups, hd]: one row per group of tokens
        e = e.view(-1, heads, head_dim)
        if rotate:
            e = e.amax(dim=-1, keepdim=True).expand(-1, heads, head_dim)
        return e.repeat_interleave(group_size, dim=0)[:num_tokens]
    per_head = head_dim // group_size  # [tokens, hd / g]
    e = e.view(num_tokens, heads, per_head)
    if rotate:
        e = e.amax(dim=-1, keepdim=True).expand(-1, heads, per_head)
    return e.repeat_interleave(group_size, dim=-1)


def classes(r_bits: torch.Tensor, e_s: torch.Tensor, coding: DtypeCoding) -> torch.Tensor:
    return (e_s - exponent(r_bits, coding) + coding.class_offset).clamp_(0, NUM_CLASSES - 1)


def zigzag(c: torch.Tensor) -> torch.Tensor:
    return torch.where(c >= 0, 2 * c, -2 * c - 1)


def unzigzag(zz: torch.Tensor) -> torch.Tensor:
    return (zz >> 1) ^ -(zz & 1)


def _bitlen(v: torch.Tensor) -> torch.Tensor:
    return torch.frexp(v.to(torch.float64))[1].to(torch.int64)


@functools.lru_cache(maxsize=16)
def _cost2_table(coding: DtypeCoding, device: torch.device) -> torch.Tensor:
    """Twice the expected bits of a value of bitlen b coded with k = k_base + j, `[bins, 16]`:
    zz < 2**k costs 1 + k; otherwise q = zz >> k is taken at the middle of its range
    [2**(b-1-k), 2**(b-k) - 1]; q >= 16 escapes (17 unary bits + k + the raw width)."""
    table = torch.empty((_BITLEN_BINS, NUM_CLASSES), dtype=torch.int64)
    for b in range(_BITLEN_BINS):
        for j in range(NUM_CLASSES):
            k = coding.k_base + j
            if b <= k:
                cost2 = 2 * (1 + k)
            elif b - k <= 4:
                cost2 = 3 * 2 ** (b - 1 - k) - 1 + 2 * (1 + k)
            else:
                cost2 = 2 * (ESCAPE_Q + 1 + k + coding.width)
            table[b, j] = cost2
    return table.to(device)


@dataclass(frozen=True)
class Section:
    """One chunk's correction section: k table, record lengths and records, as uint8 tensors."""

    k_table: torch.Tensor
    rec_len: torch.Tensor
    records: torch.Tensor

    @property
    def nbytes(self) -> int:
        return K_TABLE_BYTES + self.rec_len.numel() + self.records.numel()

    def parts(self) -> list[torch.Tensor]:
        return [self.k_table, self.rec_len, self.records]


def num_blocks(num_values: int) -> int:
    return -(-num_values // BLOCK)


@dataclass
class _Blocks:
    """Block bookkeeping of the concatenated values of several chunks."""

    chunk_of: torch.Tensor   # [N] chunk index of each value
    local: torch.Tensor      # [N] index within its chunk
    blk: torch.Tensor        # [N] global block index of each value
    rank: torch.Tensor       # [N] index within its block
    first: torch.Tensor      # [B] value index of each block's first value
    last: torch.Tensor       # [B] value index of each block's last value
    per_chunk: list[int]     # blocks of each chunk

    @classmethod
    def of(cls, counts: list[int], device) -> _Blocks:
        counts_t = torch.tensor(counts, dtype=torch.int64, device=device)
        n = int(counts_t.sum())
        chunk_of = torch.repeat_interleave(torch.arange(len(counts), device=device), counts_t)
        starts = torch.cumsum(counts_t, 0) - counts_t
        local = torch.arange(n, device=device) - starts[chunk_of]
        per_chunk = [num_blocks(c) for c in counts]
        blk_off = torch.tensor([0, *per_chunk], dtype=torch.int64, device=device).cumsum(0)[:-1]
        blk = blk_off[chunk_of] + local // BLOCK
        nblk = sum(per_chunk)
        rank = local % BLOCK
        first = torch.nonzero(rank == 0).flatten()
        sizes = torch.zeros(nblk, dtype=torch.int64, device=device).index_add_(
            0, blk, torch.ones_like(blk))
        return cls(chunk_of, local, blk, rank, first, first + sizes - 1, per_chunk)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(self.first), dtype=torch.int64, device=values.device)
        return out.index_add_(0, self.blk, values)

    def exclusive(self, values: torch.Tensor) -> torch.Tensor:
        """Exclusive prefix sum of `values` within each block."""
        before = torch.cumsum(values, 0) - values
        return before - before[self.first][self.blk]


def _k_of(k_nibbles: torch.Tensor, blocks: _Blocks, cls: torch.Tensor,
          coding: DtypeCoding) -> torch.Tensor:
    return k_nibbles[blocks.chunk_of, cls] + coding.k_base


def choose_k(zz: torch.Tensor, cls: torch.Tensor, chunk_of: torch.Tensor, local: torch.Tensor,
             nchunks: int, coding: DtypeCoding) -> torch.Tensor:
    """Each chunk's k-table nibbles `[nchunks, 16]` (int64), from the histogram of bitlen(zz) per
    class over the chunk's every HIST_STRIDE-th value (`chunk_of`, `local`: each value's chunk and
    index in it). Shared by this reference and the Triton coder (`lynx_kernels.exact_triton`)."""
    bins = nchunks * NUM_CLASSES * _BITLEN_BINS
    at = (chunk_of * NUM_CLASSES + cls) * _BITLEN_BINS + _bitlen(zz)
    # The values not sampled go to one spare bin: a boolean mask, or `bincount` (it sizes its
    # output from the data), would make the host wait for a device here.
    at = torch.where(local % HIST_STRIDE == 0, at, bins)
    hist = torch.zeros(bins + 1, dtype=torch.int64, device=zz.device).scatter_add_(
        0, at, torch.ones_like(at))[:bins].view(nchunks, NUM_CLASSES, _BITLEN_BINS)
    cost = (hist.unsqueeze(-1) * _cost2_table(coding, zz.device)).sum(dim=2)
    return cost.argmin(dim=-1)  # the first minimum: ties go to the smaller k


def encode_sections(zz: torch.Tensor, cls: torch.Tensor, x_bits: torch.Tensor,
                    counts: list[int], coding: DtypeCoding) -> list[Section]:
    """The sections of consecutive chunks holding `counts` values each (int64 `zz`, `cls`,
    `x_bits` of all of them, concatenated in order)."""
    device = zz.device
    blocks = _Blocks.of(counts, device)
    nchunks = len(counts)
    k_nib = choose_k(zz, cls, blocks.chunk_of, blocks.local, nchunks, coding)
    k = _k_of(k_nib, blocks, cls, coding)
    q = zz >> k
    esc = q >= ESCAPE_Q
    low = torch.where(esc, 0, zz & ((1 << k) - 1))
    unary = torch.where(esc, ESCAPE_Q, q)
    len_e = esc.to(torch.int64) * coding.width
    sum_l, sum_u, sum_e = blocks.sums(k), blocks.sums(unary + 1), blocks.sums(len_e)
    rec_bytes = (sum_l + sum_u + sum_e + 7) // 8
    rec_start = 8 * (torch.cumsum(rec_bytes, 0) - rec_bytes)[blocks.blk]
    total = int(rec_bytes.sum())
    words = torch.zeros(total // 4 + 2, dtype=torch.int64, device=device)
    fields = [
        (rec_start + blocks.exclusive(k), low),
        (rec_start + sum_l[blocks.blk] + blocks.exclusive(unary + 1), (1 << unary) - 1),
        ((rec_start + (sum_l + sum_u)[blocks.blk] + blocks.exclusive(len_e))[esc], x_bits[esc]),
    ]
    for pos, val in fields:
        # Disjoint bit fields: adding them into 32-bit words (held in int64) is OR-ing them.
        shifted = val << (pos & 31)
        words.index_add_(0, pos >> 5, shifted & 0xFFFFFFFF)
        words.index_add_(0, (pos >> 5) + 1, shifted >> 32)
    records = words.to(torch.int32).view(torch.uint8)[:total]
    return pack_sections(k_nib, rec_bytes, records, blocks.per_chunk)


def pack_sections(k_nib: torch.Tensor, rec_bytes: torch.Tensor, records: torch.Tensor,
                  per_chunk: list[int], ends: list[int] | None = None) -> list[Section]:
    """Each chunk's section from the coded chunks' k-table nibbles `[chunks, 16]`, every block's
    record length and all records back to back (`per_chunk`: blocks of each chunk). `ends`: the
    records' end offsets on the host where the caller has them already (the cumulative sum of
    `rec_bytes`), else computed here (a host sync on a device). Shared by this reference and the
    Triton coder."""
    k_bytes = (k_nib[:, 0::2] | (k_nib[:, 1::2] << 4)).to(torch.uint8)
    rec_len = rec_bytes.to(torch.int32).to(torch.int16).view(torch.uint8).view(-1, 2)
    if ends is None:
        ends = torch.cumsum(rec_bytes, 0).tolist()  # one host sync for every chunk
    ends = [0, *ends]
    sections, b0 = [], 0
    for c, n in enumerate(per_chunk):
        b1 = b0 + n
        sections.append(Section(k_bytes[c], rec_len[b0:b1].reshape(-1), records[ends[b0]:ends[b1]]))
        b0 = b1
    return sections


def k_nibbles(sections: list[Section]) -> torch.Tensor:
    """The sections' k-table nibbles, int64 `[chunks, 16]` (the inverse of `pack_sections`')."""
    return torch.stack([torch.stack((s.k_table & 15, s.k_table >> 4), dim=-1).reshape(-1)
                        for s in sections]).to(torch.int64)


def record_lengths(sections: list[Section]) -> torch.Tensor:
    """Every block's record length in bytes, int64, the sections' blocks in order."""
    return torch.cat([s.rec_len.view(torch.int16).to(torch.int64) & 0xFFFF
                      if s.rec_len.numel() else s.rec_len.to(torch.int64) for s in sections])


def section_layout(payload_len: int, low_bytes: int, num_values: int) -> tuple[int, int]:
    """(offset of rec_len, offset of the records) in a v2 payload; CodecError if it cannot hold
    the k table and record lengths of `num_values` values."""
    rec_len_at = low_bytes + K_TABLE_BYTES
    records_at = rec_len_at + 2 * num_blocks(num_values)
    if payload_len < records_at:
        raise CodecError(f"exact Residual payload of {payload_len} B is shorter than its low bits, "
                         f"k table and record lengths ({records_at} B)")
    return rec_len_at, records_at


# What a decoder finds wrong with a section, in the order the reference checks (a section with
# several faults is refused for the first); the Triton decoder reports the same by index.
CORRUPTIONS = (
    "a record is shorter than its low bits",
    "a unary code runs past the records",
    "a unary code runs past its record",
    f"a unary code longer than {ESCAPE_Q}",
    "an escaped value has non-zero low bits",
    "a record length does not match its contents",
    "non-zero padding bits",
    "a correction leaves the value range",
    "a NaN value",
)


def corrupt(what: str) -> CodecError:
    return CodecError(f"corrupt exact Residual section: {what}")


def _read_bits(data: torch.Tensor, pos: torch.Tensor, nbits: torch.Tensor | int) -> torch.Tensor:
    """`nbits` (<= 32) bits at bit positions `pos` of the uint8 tensor `data` (LSB first); `data`
    must extend 5 bytes past every position read."""
    byte = pos >> 3
    word = torch.zeros_like(pos)
    for i in range(5):
        word |= data[byte + i].to(torch.int64) << (8 * i)
    return (word >> (pos & 7)) & ((1 << torch.as_tensor(nbits, device=pos.device)) - 1)


def decode_sections(sections: list[Section], cls: torch.Tensor, r_bits: torch.Tensor,
                    counts: list[int], coding: DtypeCoding) -> torch.Tensor:
    """The x bits (int64) of the values of consecutive chunks from their sections, the values'
    classes and predictions; raises CodecError on any inconsistency (never reads outside the
    records it was given)."""
    device = cls.device
    blocks = _Blocks.of(counts, device)
    if not len(cls):
        return torch.zeros(0, dtype=torch.int64, device=device)
    k = _k_of(k_nibbles(sections), blocks, cls, coding)
    rec_len = record_lengths(sections)
    data = torch.cat([*(s.records for s in sections),
                      torch.zeros(8, dtype=torch.uint8, device=device)])
    rec_end = 8 * torch.cumsum(rec_len, 0)
    rec_start = rec_end - 8 * rec_len
    sum_l = blocks.sums(k)
    u_start = rec_start + sum_l
    if bool((u_start > rec_end).any()):
        raise corrupt(CORRUPTIONS[0])
    low = _read_bits(data, rec_start[blocks.blk] + blocks.exclusive(k), k)
    bits = torch.stack([(data[:-8] >> i) & 1 for i in range(8)], dim=-1).reshape(-1)
    zeros = torch.nonzero(bits == 0).flatten()
    index = torch.searchsorted(zeros, u_start)[blocks.blk] + blocks.rank
    if bool((index >= len(zeros)).any()):
        raise corrupt(CORRUPTIONS[1])
    z_pos = zeros[index]
    prev = torch.where(blocks.rank == 0, u_start[blocks.blk] - 1, z_pos.roll(1))
    q = z_pos - prev - 1
    if bool((z_pos >= rec_end[blocks.blk]).any()):
        raise corrupt(CORRUPTIONS[2])
    if bool((q > ESCAPE_Q).any()):
        raise corrupt(CORRUPTIONS[3])
    esc = q == ESCAPE_Q
    if bool((low[esc] != 0).any()):
        raise corrupt(CORRUPTIONS[4])
    u_end = z_pos[blocks.last] + 1
    e_end = u_end + coding.width * blocks.sums(esc.to(torch.int64))
    if bool(((e_end > rec_end) | (e_end <= rec_end - 8)).any()):
        raise corrupt(CORRUPTIONS[5])
    for i in range(7):  # the padding up to the record's end must be zero bits
        pad = e_end + i
        pad = pad[pad < rec_end]
        if bool(bits[pad].any()):
            raise corrupt(CORRUPTIONS[6])
    zz = (q << k) | low
    o = ordinal(r_bits, coding) + unzigzag(zz)
    half = 1 << (coding.width - 1)
    if bool(((o < -half) | (o >= half))[~esc].any()):
        raise corrupt(CORRUPTIONS[7])
    x_bits = from_ordinal(o.clamp(-half, half - 1), coding)
    e_pos = u_end[blocks.blk] + coding.width * blocks.exclusive(esc.to(torch.int64))
    x_bits[esc] = _read_bits(data, e_pos[esc], coding.width)
    check_not_nan(x_bits, coding)
    return x_bits


def check_not_nan(bits: torch.Tensor, coding: DtypeCoding) -> None:
    """An exact Residual never carries NaN (encode refuses it): one is a corrupt chunk."""
    if bool(((bits & coding.magnitude_mask) > coding.nan_above).any()):
        raise corrupt(CORRUPTIONS[8])
