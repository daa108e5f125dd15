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
Residual payload: packed low bits (target int8) or the original values (target exact).

Buffers: `to_chunks` returns new `bytes` objects owned by the caller (copy them into a transport
staging region and drop them). `parse_chunk` keeps a reference to the buffer it was given (no
copy); the caller must not reuse that buffer until the chunk has been decoded or assembled.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from functools import lru_cache

import numpy as np
import torch

from .codec import EncodedKV, protected_count
from .spec import CodecError, CodecSpec, KGrouping, StreamKind, Target

MAGIC = b"LYNX"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBBBBBHHHHHHIQIIIII")

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPES_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}
_KINDS = {StreamKind.K: 0, StreamKind.V: 1}
_KINDS_BY_CODE = {code: kind for kind, code in _KINDS.items()}
_FLAG_EXACT, _FLAG_ROTATE, _FLAG_K_PER_TOKEN = 1, 2, 4


class WireStream(IntEnum):
    ANCHOR = 0
    RESIDUAL = 1


@dataclass(frozen=True)
class ChunkHeader:
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

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    def pack(self, checksum: int) -> bytes:
        spec = self.spec
        flags = ((_FLAG_EXACT if spec.target is Target.EXACT else 0)
                 | (_FLAG_ROTATE if spec.rotate else 0)
                 | (_FLAG_K_PER_TOKEN if spec.k_grouping is KGrouping.TOKEN else 0))
        return HEADER.pack(
            MAGIC, FORMAT_VERSION, int(self.stream), _KINDS[self.kind], _DTYPES[self.dtype], flags,
            spec.anchor_bits, spec.group_size, self.layer, self.num_heads, self.head_dim,
            spec.sink_tokens, spec.recent_tokens, spec.rotation_seed, self.request_tag,
            self.total_tokens, self.token_start, self.token_end, self.payload_len, checksum,
        )

    def section_sizes(self) -> dict[str, int]:
        """Byte length of each payload section, derived from the header alone."""
        hd = self.num_heads * self.head_dim
        n = self.num_tokens
        itemsize = self.dtype.itemsize
        if self.stream is WireStream.RESIDUAL:
            if self.spec.target is Target.EXACT:
                return {"residual": n * hd * itemsize}
            return {"residual": n * hd * self.spec.residual_bits // 8}
        g = self.spec.group_size
        groups = (-(-n // g)) * hd if self.spec.groups_over_tokens(self.kind) else n * hd // g
        protected = protected_count(self.total_tokens, self.spec.sink_tokens,
                                    self.spec.recent_tokens, self.token_start, self.token_end)
        return {
            "anchor": n * hd * self.spec.anchor_bits // 8,
            "zero": groups * 2,
            "scale": groups * 2,
            "protected": protected * hd * itemsize,
        }


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

    def residual_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The Residual chunk's payload, shaped as `EncodedKV.residual` rows for its range."""
        if self.header.stream is not WireStream.RESIDUAL:
            raise CodecError("residual_tensor needs a Residual chunk")
        return _residual_rows([self], device)


def _checksum(header: ChunkHeader, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(header.pack(0)))


def _split(payload: memoryview, sizes: dict[str, int]) -> dict[str, memoryview]:
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = payload[offset: offset + size]
        offset += size
    return out


def _tensor(views: Sequence[memoryview], dtype: torch.dtype, shape, device) -> torch.Tensor:
    """The bytes of `views`, joined, as a new tensor (one copy; the views may be read-only)."""
    parts = [np.frombuffer(v, dtype=np.uint8) for v in views if len(v)]
    raw = torch.from_numpy(np.concatenate(parts)) if parts else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _anchor_run(anchors: Sequence[Chunk], device) -> EncodedKV:
    """Anchor chunks that tile a run, in token order, as one EncodedKV (no residual)."""
    h, last = anchors[0].header, anchors[-1].header
    sections = [_split(c.payload, c.header.section_sizes()) for c in anchors]
    joined = lambda name, dtype, shape: _tensor([s[name] for s in sections], dtype, shape,  # noqa: E731
                                                device)
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


def _residual_rows(residuals: Sequence[Chunk], device) -> torch.Tensor:
    """Residual chunks that tile a run, in token order, as `EncodedKV.residual` rows."""
    h = residuals[0].header
    n = residuals[-1].header.token_end - h.token_start
    payloads = [c.payload for c in residuals]
    if h.spec.target is Target.EXACT:
        return _tensor(payloads, h.dtype, (n, h.num_heads, h.head_dim), device)
    return _tensor(payloads, torch.uint8, (n, -1), device)


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's rows as a `[rows, row bytes]` uint8 array sharing its memory."""
    row_bytes = t[0].numel() * t.element_size() if len(t) else 0
    return t.detach().contiguous().view(torch.uint8).reshape(len(t), row_bytes).numpy()


def _sections(enc: EncodedKV, stream: WireStream) -> list[tuple[np.ndarray, int]]:
    """The run's tensors of `stream`, in payload order, as byte rows, each with which of
    `EncodedKV.rows` indexes it (0 tokens, 1 groups, 2 protected)."""
    if stream is WireStream.ANCHOR:
        return [(_byte_rows(enc.anchor), 0), (_byte_rows(enc.zero), 1),
                (_byte_rows(enc.scale), 1), (_byte_rows(enc.protected), 2)]
    if enc.residual is None:
        raise CodecError("cannot emit Residual chunks: this EncodedKV has no residual")
    return [(_byte_rows(enc.residual), 0)]


def _checked_stream(enc: EncodedKV, chunk_tokens: int, stream: str, request_tag: int) -> WireStream:
    try:
        wire_stream = WireStream[stream.upper()]
    except KeyError:
        raise CodecError(f"stream must be 'anchor' or 'residual', got {stream!r}") from None
    if chunk_tokens <= 0:
        raise CodecError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if enc.over_tokens and chunk_tokens % enc.spec.group_size:
        raise CodecError(
            f"chunk_tokens={chunk_tokens} must be a multiple of group_size="
            f"{enc.spec.group_size} when K is grouped per channel"
        )
    if not 0 <= request_tag < 2**64:
        raise CodecError(f"request_tag must fit in 64 bits, got {request_tag}")
    return wire_stream


def write_chunks(enc: EncodedKV, chunk_tokens: int, out, *, stream: str = "anchor",
                 request_tag: int = 0) -> list[int]:
    """`to_chunks` written back to back into the writable buffer `out` (a staging region, say)
    instead of new `bytes`; returns the chunks' lengths. The bytes are exactly `to_chunks`'."""
    wire_stream = _checked_stream(enc, chunk_tokens, stream, request_tag)
    buf = np.frombuffer(out, dtype=np.uint8)
    # Byte views of the whole run once (one device copy for CUDA); chunks are row ranges of them.
    sections = _sections(_on_cpu(enc), wire_stream)
    lengths, pos = [], 0
    for start, end, ranges in _chunk_rows(enc, chunk_tokens):
        parts = [rows[ranges[which]] for rows, which in sections]
        header = ChunkHeader(
            stream=wire_stream, spec=enc.spec, kind=enc.kind, dtype=enc.dtype, layer=enc.layer,
            num_heads=enc.num_heads, head_dim=enc.head_dim, request_tag=request_tag,
            total_tokens=enc.total_tokens, token_start=start, token_end=end,
            payload_len=sum(p.size for p in parts),
        )
        chunk_end = pos + HEADER.size + header.payload_len
        if chunk_end > len(buf):
            raise CodecError(f"output buffer of {len(buf)} B is too small: chunk of tokens "
                             f"[{start}, {end}) ends at byte {chunk_end}")
        at = pos + HEADER.size
        for p in parts:
            buf[at: at + p.size] = p.reshape(-1)
            at += p.size
        buf[pos: pos + HEADER.size] = np.frombuffer(header.pack(0), dtype=np.uint8)
        # zlib.crc32(header + payload) == _checksum(header, payload): one pass over the bytes.
        checksum = zlib.crc32(buf[pos: chunk_end])
        buf[pos: pos + HEADER.size] = np.frombuffer(header.pack(checksum), dtype=np.uint8)
        lengths.append(chunk_end - pos)
        pos = chunk_end
    return lengths


def _chunk_rows(enc: EncodedKV, chunk_tokens: int):
    """(start, end, `enc.rows(start, end)`) of each chunk."""
    for start in range(enc.token_start, enc.token_end, chunk_tokens):
        end = min(start + chunk_tokens, enc.token_end)
        yield start, end, enc.rows(start, end)


def _on_cpu(enc: EncodedKV) -> EncodedKV:
    if enc.device.type == "cpu":
        return enc
    move = lambda t: None if t is None else t.cpu()  # noqa: E731
    return replace(enc, anchor=move(enc.anchor), zero=move(enc.zero), scale=move(enc.scale),
                   protected=move(enc.protected), residual=move(enc.residual))


def to_chunks(enc: EncodedKV, chunk_tokens: int, *, stream: str = "anchor",
              request_tag: int = 0) -> list[bytes]:
    """Serialize `stream` ("anchor" or "residual") of `enc` as chunks of `chunk_tokens` tokens."""
    enc = _on_cpu(enc)
    sections = _sections(enc, _checked_stream(enc, chunk_tokens, stream, request_tag))
    buf = bytearray(sum(
        HEADER.size + sum((ranges[which].stop - ranges[which].start) * rows.shape[1]
                          for rows, which in sections)
        for _, _, ranges in _chunk_rows(enc, chunk_tokens)))
    lengths = write_chunks(enc, chunk_tokens, buf, stream=stream, request_tag=request_tag)
    chunks, pos = [], 0
    for n in lengths:
        chunks.append(bytes(buf[pos: pos + n]))
        pos += n
    return chunks


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
        raise CodecError(f"chunk format version {version}, this codec reads {FORMAT_VERSION}")
    if stream not in (0, 1) or kind not in _KINDS_BY_CODE or dtype not in _DTYPES_BY_CODE:
        raise CodecError(f"corrupt chunk header (stream={stream}, kind={kind}, dtype={dtype})")
    if flags & ~(_FLAG_EXACT | _FLAG_ROTATE | _FLAG_K_PER_TOKEN):
        raise CodecError(f"corrupt chunk header (unknown flags {flags:#x})")
    if not start < end <= total:
        raise CodecError(f"corrupt chunk header (token range [{start}, {end}) of {total})")
    spec = _spec(anchor_bits, group_size, flags, sink, recent, seed)
    header = ChunkHeader(
        stream=WireStream(stream), spec=spec, kind=_KINDS_BY_CODE[kind],
        dtype=_DTYPES_BY_CODE[dtype], layer=layer, num_heads=heads, head_dim=head_dim,
        request_tag=request_tag, total_tokens=total, token_start=start, token_end=end,
        payload_len=payload_len,
    )
    payload = view[HEADER.size:]
    if len(payload) != payload_len:
        raise CodecError(
            f"layer {layer} tokens [{start}, {end}): payload is {len(payload)} bytes, header "
            f"says {payload_len} (truncated or trailing bytes)"
        )
    expected = sum(header.section_sizes().values())
    if payload_len != expected:
        raise CodecError(
            f"layer {layer} tokens [{start}, {end}): payload_len {payload_len} does not match the "
            f"{expected} bytes its parameters imply"
        )
    if _checksum(header, payload) != checksum:
        raise CodecError(
            f"layer {layer} {header.kind.value.upper()} {header.stream.name} tokens "
            f"[{start}, {end}): checksum mismatch (corrupt chunk)"
        )
    if header.spec.groups_over_tokens(header.kind) and start % group_size:
        raise CodecError(f"chunk starts at token {start}, not a multiple of group_size")
    return Chunk(header=header, payload=payload)


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
             device: torch.device | str = "cpu") -> EncodedKV:
    """Join the chunks of one run (one layer's K or V), given in any order, into one EncodedKV.

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
    enc = _anchor_run(anchors, device)
    start, end = enc.token_start, enc.token_end
    if residuals:
        residuals = _contiguous(residuals, "Residual")
        if (residuals[0].header.token_start, residuals[-1].header.token_end) != (start, end):
            raise CodecError(
                f"Residual chunks cover [{residuals[0].header.token_start}, "
                f"{residuals[-1].header.token_end}), Anchor chunks [{start}, {end})"
            )
        enc = replace(enc, residual=_residual_rows(residuals, device))
    return enc

