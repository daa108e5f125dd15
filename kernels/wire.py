"""Chunked, self-describing wire format for encoded KV.

The prefill side cuts an `EncodedKV` into chunks by token range (`to_chunks`); each chunk is a
fixed header followed by its payload, so the decode side can validate and place every chunk on its
own, in any order (`parse_chunk`, then `assemble` or `Chunk.to_encoded`). The header carries the
codec parameters, and a CRC-32 over header and payload: a chunk whose header or bytes do not check
out is rejected with a `CodecError`, never applied.

Header (little endian, `HEADER.size` bytes): magic "LYNX", format version, stream (0 Anchor,
1 Residual), kind (0 K, 1 V), dtype, flags, anchor_bits, group_size, layer, kv heads, head_dim,
sink/recent tokens, rotation seed, request tag, total tokens of the run, token range
[start, end), payload length, CRC-32.
Anchor payload: packed anchor bits, zero (fp16), scale (fp16), protected tokens (original dtype).
Residual payload: packed low bits (target int8); target exact: packed low bits + the correction
section of `lynx_kernels.exact` (variable length), or, flagged "raw" in the header when that would
be longer, the chunk's original values. `ChunkHeader.section_sizes` gives the raw form's length:
the bound staging is sized with.

Version 2 (this one) changed the rotation to a pinned FWHT (Anchor bytes of rotated specs) and the
exact Residual to low bits + correction; a version-1 chunk is refused.

The sending side (`to_chunks`, `write_chunks`, `wire_nbytes`) is `lynx_kernels.wire_write`.

Buffers: `parse_chunk` keeps a reference to the buffer it was given (no copy); the caller must not reuse
that buffer until the chunk has been decoded or assembled.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from functools import lru_cache

import numpy as np
import torch

from . import exact, ops_cpu
from .codec import EncodedKV, protected_count, protected_positions, reconstruct
from .spec import CodecError, CodecSpec, KGrouping, StreamKind, Target

MAGIC = b"LYNX"
FORMAT_VERSION = 2
HEADER = struct.Struct("<4sBBBBBBHHHHHHIQIIIII")

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPES_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}
_KINDS = {StreamKind.K: 0, StreamKind.V: 1}
_KINDS_BY_CODE = {code: kind for kind, code in _KINDS.items()}
_FLAG_EXACT, _FLAG_ROTATE, _FLAG_K_PER_TOKEN, _FLAG_RAW = 1, 2, 4, 8


def spec_flags(spec: CodecSpec) -> int:
    """The header flags a spec sets (every chunk of its runs carries them)."""
    return ((_FLAG_EXACT if spec.target is Target.EXACT else 0)
            | (_FLAG_ROTATE if spec.rotate else 0)
            | (_FLAG_K_PER_TOKEN if spec.k_grouping is KGrouping.TOKEN else 0))


class WireStream(IntEnum):
    ANCHOR = 0
    RESIDUAL = 1


@dataclass(frozen=True)
class ChunkHeader:
    """One chunk's header. `raw`: an exact Residual chunk carried as its original values (the
    coded form would have been longer)."""

    stream: WireStream
    spec: CodecSpec
    kind: StreamKind
    dtype: torch.dtype
    layer: int
    num_heads: int
    head_dim: int
    request_tag: int
    total_tokens: int
    token_start: int
    token_end: int
    payload_len: int
    raw: bool = False

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def coded_exact(self) -> bool:
        """An exact Residual chunk in the coded form (low bits + correction section)."""
        return (self.stream is WireStream.RESIDUAL and self.spec.target is Target.EXACT
                and not self.raw)

    @property
    def protected_tokens(self) -> int:
        return protected_count(self.total_tokens, self.spec.sink_tokens, self.spec.recent_tokens,
                               self.token_start, self.token_end)

    @property
    def coded_values(self) -> int:
        """Values the correction section of an exact Residual chunk codes (its unprotected ones)."""
        return (self.num_tokens - self.protected_tokens) * self.num_heads * self.head_dim

    @property
    def low_bits_nbytes(self) -> int:
        return self.num_tokens * self.num_heads * self.head_dim * self.spec.residual_bits // 8

    def pack(self, checksum: int) -> bytes:
        spec = self.spec
        flags = spec_flags(spec) | (_FLAG_RAW if self.raw else 0)
        return HEADER.pack(
            MAGIC, FORMAT_VERSION, int(self.stream), _KINDS[self.kind], _DTYPES[self.dtype], flags,
            spec.anchor_bits, spec.group_size, self.layer, self.num_heads, self.head_dim,
            spec.sink_tokens, spec.recent_tokens, spec.rotation_seed, self.request_tag,
            self.total_tokens, self.token_start, self.token_end, self.payload_len, checksum,
        )

    def section_sizes(self) -> dict[str, int]:
        """Byte length of each payload section, derived from the header alone. For an exact
        Residual chunk: its raw form, the most a coded one may take (what staging is sized for)."""
        hd = self.num_heads * self.head_dim
        n = self.num_tokens
        itemsize = self.dtype.itemsize
        if self.stream is WireStream.RESIDUAL:
            if self.spec.target is Target.EXACT:
                return {"residual": n * hd * itemsize}
            return {"residual": self.low_bits_nbytes}
        g = self.spec.group_size
        groups = (-(-n // g)) * hd if self.spec.groups_over_tokens(self.kind) else n * hd // g
        return {
            "anchor": n * hd * self.spec.anchor_bits // 8,
            "zero": groups * 2,
            "scale": groups * 2,
            "protected": self.protected_tokens * hd * itemsize,
        }

    def bound(self) -> int:
        """The most payload bytes a chunk with this header may carry."""
        return sum(self.section_sizes().values())


@dataclass(frozen=True)
class Chunk:
    header: ChunkHeader
    payload: memoryview

    def to_bytes(self) -> bytes:
        body = bytes(self.payload)
        return self.header.pack(_checksum(self.header, body)) + body

    def to_encoded(self, device: torch.device | str = "cpu") -> EncodedKV:
        """The Anchor chunk as an EncodedKV for its token range (tensors copied onto `device`)."""
        if self.header.stream is not WireStream.ANCHOR:
            raise CodecError("to_encoded needs an Anchor chunk; attach Residuals with assemble()")
        return _anchor_run([self], device)

    def exact_section(self, copy: DeviceCopy | None = None) -> exact.Section:
        """The correction section of a coded exact Residual chunk (a copy of its payload's
        bytes; views of `copy`'s device bytes where they hold the payload)."""
        h = self.header
        rec_len_at, records_at = exact.section_layout(len(self.payload), h.low_bits_nbytes,
                                                      h.coded_values)
        at = h.low_bits_nbytes
        data = None if copy is None else copy.piece(self.payload[at:])
        if data is not None:
            data = data.clone()  # at offset 0: the record lengths are read as int16
        else:
            data = torch.from_numpy(np.frombuffer(self.payload[at:], dtype=np.uint8).copy())
        return exact.Section(data[: rec_len_at - at], data[rec_len_at - at: records_at - at],
                             data[records_at - at:])


def crc32(data, crc: int = 0) -> int:
    """zlib's CRC-32 of the bytes `data` (continuing `crc`), by the C codec where it is built:
    ~28 GB/s here against zlib's ~2.2, and every chunk sent or received is checked whole."""
    return ops_cpu.crc32(data, crc) if ops_cpu.available() else zlib.crc32(data, crc)


def _checksum(header: ChunkHeader, payload: bytes | memoryview) -> int:
    return crc32(payload, crc32(header.pack(0)))


def _split(payload: memoryview, sizes: dict[str, int]) -> dict[str, memoryview]:
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = payload[offset: offset + size]
        offset += size
    return out


class DeviceCopy:
    """Byte buffers copied onto a device once each: `assemble` then slices the pieces it joins out
    of those copies, where copying each piece over on its own took dozens of small synchronous
    copies per run. Made by `fused.apply_*` for a device pool from the run's landed Anchor and
    Residual bytes. The copies are synchronous, so the host buffers are free again when this is
    made (a non-blocking copy could still be reading staging the decode frees after the apply)."""

    def __init__(self, buffers: Sequence[np.ndarray], device: torch.device | str):
        self.device = torch.device(device)
        # (host address, length, the bytes on the device) of each buffer
        self._spans: list[tuple[int, int, torch.Tensor]] = []
        for buf in buffers:
            host = buf if buf.flags.writeable else buf.copy()  # torch wants writable memory
            self._spans.append((buf.ctypes.data, buf.size,
                                torch.from_numpy(host).to(self.device, copy=True)))

    def piece(self, view: memoryview) -> torch.Tensor | None:
        """The device bytes of `view` if it lies inside one of the buffers, else None."""
        arr = np.frombuffer(view, dtype=np.uint8)
        at = arr.ctypes.data
        for base, size, dev in self._spans:
            if base <= at and at + arr.size <= base + size:
                return dev[at - base: at - base + arr.size]
        return None

    def join(self, views: Sequence[memoryview]) -> torch.Tensor | None:
        """The bytes of `views`, joined, as a new device tensor; None if one lies outside."""
        pieces = [self.piece(v) for v in views if len(v)]
        if any(p is None for p in pieces):
            return None
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8,
                                                            device=self.device)


def _tensor(views: Sequence[memoryview], dtype: torch.dtype, shape, device,
            copy: DeviceCopy | None = None) -> torch.Tensor:
    """The bytes of `views`, joined, as a new tensor on `device` (the views may be read-only):
    sliced out of `copy` where it holds them, else joined on the host and copied over."""
    raw = None if copy is None else copy.join(views)
    if raw is not None:
        return raw.view(dtype).reshape(shape)
    parts = [np.frombuffer(v, dtype=np.uint8) for v in views if len(v)]
    raw = torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _anchor_run(anchors: Sequence[Chunk], device, copy: DeviceCopy | None = None) -> EncodedKV:
    """Anchor chunks that tile a run, in token order, as one EncodedKV (no residual)."""
    h, last = anchors[0].header, anchors[-1].header
    sections = [_split(c.payload, c.header.section_sizes()) for c in anchors]
    joined = lambda name, dtype, shape: _tensor([s[name] for s in sections], dtype, shape,  # noqa: E731
                                                device, copy)
    hd = h.num_heads * h.head_dim
    group_cols = hd if h.spec.groups_over_tokens(h.kind) else hd // h.spec.group_size
    num_tokens = last.token_end - h.token_start
    return EncodedKV(
        spec=h.spec, kind=h.kind, layer=h.layer, dtype=h.dtype, num_heads=h.num_heads,
        head_dim=h.head_dim, total_tokens=h.total_tokens, token_start=h.token_start,
        num_tokens=num_tokens,
        anchor=joined("anchor", torch.uint8, (num_tokens, -1)),
        zero=joined("zero", torch.float16, (-1, group_cols)),
        scale=joined("scale", torch.float16, (-1, group_cols)),
        protected=joined("protected", h.dtype, (-1, h.num_heads, h.head_dim)),
        residual=None,
    )


def _residual_rows(residuals: Sequence[Chunk], anchor: EncodedKV, device,
                   copy: DeviceCopy | None = None) -> torch.Tensor:
    """Residual chunks that tile the run of `anchor`, in token order, as `EncodedKV.residual`."""
    h = residuals[0].header
    if h.spec.target is Target.INT8:
        return _tensor([c.payload for c in residuals], torch.uint8, (anchor.num_tokens, -1), device,
                       copy)
    return _exact_values(residuals, anchor, copy)


def _exact_values(residuals: Sequence[Chunk], anchor: EncodedKV,
                  copy: DeviceCopy | None = None) -> torch.Tensor:
    """The original values `[n, heads, head_dim]` of an exact run: raw chunks' payloads, coded
    chunks' corrections applied to the INT8 reconstruction (anchor + low bits)."""
    h = residuals[0].header
    coding = exact.CODINGS[h.dtype]
    n, hd = anchor.num_tokens, h.num_heads * h.head_dim
    shape = (n, h.num_heads, h.head_dim)
    device = anchor.device
    bits = torch.zeros(shape, dtype=torch.int64, device=device)
    low = torch.zeros((n, hd * h.spec.residual_bits // 8), dtype=torch.uint8, device=device)
    coded = torch.zeros(n, dtype=torch.bool)  # on the host: the headers say (`coded_rows`)
    sections, counts = [], []
    for c in residuals:
        rows = slice(c.header.token_start - anchor.token_start, c.header.token_end - anchor.token_start)
        if c.header.raw:
            raw = exact.value_bits(_tensor([c.payload], h.dtype, (-1, *shape[1:]), device, copy))
            exact.check_not_nan(raw, coding)
            bits[rows] = raw
            continue
        low[rows] = _tensor([c.payload[: c.header.low_bits_nbytes]], torch.uint8, (-1, low.shape[1]),
                            device, copy)
        coded[rows] = True
        sections.append(c.exact_section(copy))
        counts.append(c.header.coded_values)
    if sections:
        kept = coded_rows(anchor, coded)
        r_bits = exact.value_bits(reconstruct(anchor, low)).index_select(0, kept)
        e_s = exact.scale_exponents(anchor.scale, n, h.num_heads, h.head_dim, h.spec.group_size,
                                    anchor.over_tokens, h.spec.rotate).index_select(0, kept)
        sections = [exact.Section(*(t.to(device) for t in s.parts())) for s in sections]
        _, decode_sections = section_coder(device)
        bits.index_copy_(0, kept, decode_sections(
            sections, exact.classes(r_bits, e_s, coding).reshape(-1), r_bits.reshape(-1), counts,
            coding).view(-1, h.num_heads, h.head_dim))
    values = exact.bits_to_values(bits, h.dtype)
    values[protected_rows(anchor)] = anchor.protected
    return values


def section_coder(device: torch.device | str) -> tuple[Callable, Callable]:
    """(encode_sections, decode_sections) of the exact Residual for tensors on `device`: the Triton
    kernels (`lynx_kernels.exact_triton`, imported on first use: Triton only where CUDA is) on
    CUDA, the torch reference (`lynx_kernels.exact`) elsewhere (CPU pools' serving path is the C
    codec, `ops_cpu`, which codes without either)."""
    if torch.device(device).type == "cuda":
        from . import exact_triton

        return exact_triton.encode_sections, exact_triton.decode_sections
    return exact.encode_sections, exact.decode_sections


def protected_rows(enc: EncodedKV, device: torch.device | str | None = None) -> torch.Tensor:
    """The rows of `enc` that are protected tokens (sent as they are), on `device` (default: the
    run's)."""
    positions = protected_positions(enc.total_tokens, enc.spec.sink_tokens,
                                    enc.spec.recent_tokens, enc.token_start, enc.token_end)
    return (positions - enc.token_start).to(enc.device if device is None else device)


def coded_rows(enc: EncodedKV, among: torch.Tensor | None = None) -> torch.Tensor:
    """The indices, on the run's device, of `enc`'s rows that are not protected tokens, of those
    the CPU bool mask `among` marks (None: every row). Computed on the host: a boolean mask on a
    device tensor would make the host wait for the device (its result's size depends on the
    data)."""
    keep = torch.ones(enc.num_tokens, dtype=torch.bool) if among is None else among.clone()
    keep[protected_rows(enc, "cpu")] = False
    return keep.nonzero().squeeze(1).to(enc.device)


def parse_chunk(buf: bytes | bytearray | memoryview) -> Chunk:
    """Validate one chunk (header fields, lengths, CRC-32) and return it; raises CodecError."""
    view = memoryview(buf).cast("B")
    if len(view) < HEADER.size:
        raise CodecError(f"truncated chunk: {len(view)} bytes, the header alone is {HEADER.size}")
    (magic, version, stream, kind, dtype, flags, anchor_bits, group_size, layer, heads, head_dim,
     sink, recent, seed, request_tag, total, start, end, payload_len, checksum) = HEADER.unpack(
        view[:HEADER.size])
    if magic != MAGIC:
        raise CodecError(f"not a Lynx chunk (magic {bytes(magic)!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"chunk format version {version}, this codec reads {FORMAT_VERSION}: "
                         "prefill and decode run different lynx-sglang versions")
    if stream not in (0, 1) or kind not in _KINDS_BY_CODE or dtype not in _DTYPES_BY_CODE:
        raise CodecError(f"corrupt chunk header (stream={stream}, kind={kind}, dtype={dtype})")
    if flags & ~(_FLAG_EXACT | _FLAG_ROTATE | _FLAG_K_PER_TOKEN | _FLAG_RAW) or (
            flags & _FLAG_RAW and not (stream == WireStream.RESIDUAL and flags & _FLAG_EXACT)):
        raise CodecError(f"corrupt chunk header (flags {flags:#x})")
    if not start < end <= total:
        raise CodecError(f"corrupt chunk header (token range [{start}, {end}) of {total})")
    spec = _spec(anchor_bits, group_size, flags & ~_FLAG_RAW, sink, recent, seed)
    header = ChunkHeader(
        stream=WireStream(stream), spec=spec, kind=_KINDS_BY_CODE[kind],
        dtype=_DTYPES_BY_CODE[dtype], layer=layer, num_heads=heads, head_dim=head_dim,
        request_tag=request_tag, total_tokens=total, token_start=start, token_end=end,
        payload_len=payload_len, raw=bool(flags & _FLAG_RAW),
    )
    payload = view[HEADER.size:]
    if len(payload) != payload_len:
        raise CodecError(
            f"layer {layer} tokens [{start}, {end}): payload is {len(payload)} bytes, header "
            f"says {payload_len} (truncated or trailing bytes)"
        )
    _check_payload_len(header, payload)
    if _checksum(header, payload) != checksum:
        raise CodecError(
            f"layer {layer} {header.kind.value.upper()} {header.stream.name} tokens "
            f"[{start}, {end}): checksum mismatch (corrupt chunk)"
        )
    if header.spec.groups_over_tokens(header.kind) and start % group_size:
        raise CodecError(f"chunk starts at token {start}, not a multiple of group_size")
    return Chunk(header=header, payload=payload)


def _check_payload_len(header: ChunkHeader, payload: memoryview) -> None:
    """The payload length its header implies: exactly the sections' (a coded exact Residual: at most
    the bound, and exactly its low bits, k table, record lengths and the records they sum to)."""
    where = f"layer {header.layer} tokens [{header.token_start}, {header.token_end})"
    bound = header.bound()
    if not header.coded_exact:
        if header.payload_len != bound:
            raise CodecError(f"{where}: payload_len {header.payload_len} does not match the "
                             f"{bound} bytes its parameters imply")
        return
    if header.payload_len > bound:
        raise CodecError(f"{where}: exact Residual payload_len {header.payload_len} exceeds its "
                         f"bound of {bound} bytes")
    rec_len_at, records_at = exact.section_layout(header.payload_len, header.low_bits_nbytes,
                                                  header.coded_values)
    records = int(np.frombuffer(payload[rec_len_at: records_at], dtype="<u2").sum(dtype=np.int64))
    if records_at + records != header.payload_len:
        raise CodecError(f"{where}: exact Residual record lengths sum to {records} bytes, the "
                         f"payload holds {header.payload_len - records_at}")


@lru_cache(maxsize=64)
def _spec(anchor_bits: int, group_size: int, flags: int, sink: int, recent: int,
          seed: int) -> CodecSpec:
    # Every chunk of a transfer carries the same parameters: validate and build them once.
    return CodecSpec(
        anchor_bits=anchor_bits, group_size=group_size,
        target=Target.EXACT if flags & _FLAG_EXACT else Target.INT8,
        k_grouping=KGrouping.TOKEN if flags & _FLAG_K_PER_TOKEN else KGrouping.CHANNEL,
        sink_tokens=sink, recent_tokens=recent, rotate=bool(flags & _FLAG_ROTATE),
        rotation_seed=seed,
    )


def _same_run(a: ChunkHeader, b: ChunkHeader) -> bool:
    return (a.spec, a.kind, a.dtype, a.layer, a.num_heads, a.head_dim, a.request_tag,
            a.total_tokens) == (b.spec, b.kind, b.dtype, b.layer, b.num_heads, b.head_dim,
                                b.request_tag, b.total_tokens)


def _contiguous(chunks: Sequence[Chunk], what: str) -> list[Chunk]:
    ordered = sorted(chunks, key=lambda c: c.header.token_start)
    for prev, nxt in itertools.pairwise(ordered):
        if prev.header.token_end != nxt.header.token_start:
            raise CodecError(
                f"{what} chunks do not tile the run: [{prev.header.token_start}, "
                f"{prev.header.token_end}) then [{nxt.header.token_start}, "
                f"{nxt.header.token_end})"
            )
    return ordered


def assemble(chunks: Iterable[bytes | bytearray | memoryview | Chunk],
             device: torch.device | str = "cpu", *, copy: DeviceCopy | None = None) -> EncodedKV:
    """Join the chunks of one run (one layer's K or V), given in any order, into one EncodedKV
    on `device` (with `copy`: the payloads it holds sliced out of its device bytes).

    Anchor chunks must tile a contiguous token range; Residual chunks, if any, must tile the same
    range (then the result carries the residual and can be fully decoded).
    """
    parsed = [c if isinstance(c, Chunk) else parse_chunk(c) for c in chunks]
    anchors = [c for c in parsed if c.header.stream is WireStream.ANCHOR]
    residuals = [c for c in parsed if c.header.stream is WireStream.RESIDUAL]
    if not anchors:
        raise CodecError("assemble needs at least one Anchor chunk")
    first = anchors[0].header
    for c in parsed:
        if not _same_run(first, c.header):
            raise CodecError(
                f"chunk of layer {c.header.layer} {c.header.kind.value.upper()} (tag "
                f"{c.header.request_tag}) does not belong to the run of layer {first.layer} "
                f"{first.kind.value.upper()} (tag {first.request_tag})"
            )
    anchors = _contiguous(anchors, "Anchor")
    enc = _anchor_run(anchors, device, copy)
    start, end = enc.token_start, enc.token_end
    if residuals:
        residuals = _contiguous(residuals, "Residual")
        if (residuals[0].header.token_start, residuals[-1].header.token_end) != (start, end):
            raise CodecError(
                f"Residual chunks cover [{residuals[0].header.token_start}, "
                f"{residuals[-1].header.token_end}), Anchor chunks [{start}, {end})"
            )
        enc = replace(enc, residual=_residual_rows(residuals, enc, device, copy))
    return enc

