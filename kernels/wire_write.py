"""The sending side of the wire format (`lynx_kernels.wire`): an `EncodedKV` cut into chunks by
token range, each a header and its payload (`to_chunks` as new `bytes`, `write_chunks` straight into
a caller's buffer), and `wire_nbytes`, what that puts on the wire. The format itself, and the
receiving side (`parse_chunk`, `assemble`), are in `wire`.

Buffers: `to_chunks` returns new `bytes` objects owned by the caller (copy them into a transport
staging region and drop them); `write_chunks` fills a caller's buffer and keeps no reference.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import exact
from .codec import EncodedKV, exact_parts
from .spec import CodecError, Target
from .wire import HEADER, ChunkHeader, WireStream, protected_rows, section_coder


def _byte_rows(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's rows as a `[rows, row bytes]` uint8 array sharing its memory."""
    row_bytes = t[0].numel() * t.element_size() if len(t) else 0
    return t.detach().contiguous().view(torch.uint8).reshape(len(t), row_bytes).numpy()


def _flat(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


@dataclass(frozen=True)
class _Payload:
    """A chunk to write: its header (payload_len set) and its payload's byte pieces in order."""

    header: ChunkHeader
    parts: list[np.ndarray]


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
    if wire_stream is WireStream.RESIDUAL and enc.residual is None:
        raise CodecError("cannot emit Residual chunks: this EncodedKV has no residual")
    return wire_stream


def _payloads(enc: EncodedKV, chunk_tokens: int, stream: str, request_tag: int) -> list[_Payload]:
    """Every chunk of `stream` of the run, cut every `chunk_tokens` tokens."""
    wire_stream = _checked_stream(enc, chunk_tokens, stream, request_tag)
    chunks = list(_chunk_rows(enc, chunk_tokens))
    if wire_stream is WireStream.ANCHOR:
        cpu = _on_cpu(enc)
        sections = [(_byte_rows(cpu.anchor), 0), (_byte_rows(cpu.zero), 1),
                    (_byte_rows(cpu.scale), 1), (_byte_rows(cpu.protected), 2)]
        pieces = [([rows[ranges[which]] for rows, which in sections], False)
                  for _, _, ranges in chunks]
    elif enc.spec.target is Target.INT8:
        rows = _byte_rows(enc.residual.cpu())
        pieces = [([rows[ranges[0]]], False) for _, _, ranges in chunks]
    else:
        pieces = _exact_pieces(enc, chunks)
    payloads = []
    for (start, end, _), (parts, raw) in zip(chunks, pieces, strict=True):
        header = ChunkHeader(
            stream=wire_stream, spec=enc.spec, kind=enc.kind, dtype=enc.dtype, layer=enc.layer,
            num_heads=enc.num_heads, head_dim=enc.head_dim, request_tag=request_tag,
            total_tokens=enc.total_tokens, token_start=start, token_end=end,
            payload_len=sum(p.size for p in parts), raw=raw,
        )
        payloads.append(_Payload(header, parts))
    return payloads


def _exact_pieces(enc: EncodedKV, chunks) -> list[tuple[list[np.ndarray], bool]]:
    """Each chunk's exact Residual payload pieces and whether it is raw (see lynx_kernels.exact)."""
    coding = exact.CODINGS[enc.dtype]
    low, prediction = exact_parts(enc)
    keep = torch.ones(enc.num_tokens, dtype=torch.bool, device=enc.device)
    keep[protected_rows(enc)] = False
    x_bits = exact.value_bits(enc.residual)[keep].reshape(-1)
    r_bits = exact.value_bits(prediction)[keep].reshape(-1)
    e_s = exact.scale_exponents(enc.scale, enc.num_tokens, enc.num_heads, enc.head_dim,
                                enc.spec.group_size, enc.over_tokens, enc.spec.rotate)
    hd = enc.num_heads * enc.head_dim
    counts = [(rows.stop - rows.start - (prot.stop - prot.start)) * hd
              for _, _, (rows, _, prot) in chunks]
    encode_sections, _ = section_coder(enc.device)
    sections = encode_sections(
        exact.zigzag(exact.ordinal(x_bits, coding) - exact.ordinal(r_bits, coding)),
        exact.classes(r_bits, e_s[keep].reshape(-1), coding), x_bits, counts, coding)
    low_rows, value_rows = _byte_rows(low.cpu()), _byte_rows(enc.residual.cpu())
    pieces = []
    for (_, _, (rows, _, _)), section in zip(chunks, sections, strict=True):
        coded = [low_rows[rows], *(_flat(t) for t in section.parts())]
        raw = [value_rows[rows]]
        if sum(p.size for p in coded) <= raw[0].size:
            pieces.append((coded, False))
        else:
            pieces.append((raw, True))
    return pieces


def _write(payloads: list[_Payload], out) -> list[int]:
    buf = np.frombuffer(out, dtype=np.uint8)
    lengths, pos = [], 0
    for p in payloads:
        header = p.header
        chunk_end = pos + HEADER.size + header.payload_len
        if chunk_end > len(buf):
            raise CodecError(f"output buffer of {len(buf)} B is too small: chunk of tokens "
                             f"[{header.token_start}, {header.token_end}) ends at byte {chunk_end}")
        at = pos + HEADER.size
        for part in p.parts:
            buf[at: at + part.size] = part.reshape(-1)
            at += part.size
        buf[pos: pos + HEADER.size] = np.frombuffer(header.pack(0), dtype=np.uint8)
        # zlib.crc32(header + payload) == wire._checksum(header, payload): one pass over the bytes.
        crc = zlib.crc32(buf[pos: chunk_end])
        buf[pos: pos + HEADER.size] = np.frombuffer(header.pack(crc), dtype=np.uint8)
        lengths.append(chunk_end - pos)
        pos = chunk_end
    return lengths


def write_chunks(enc: EncodedKV, chunk_tokens: int, out, *, stream: str = "anchor",
                 request_tag: int = 0) -> list[int]:
    """`to_chunks` written back to back into the writable buffer `out` (a staging region, say)
    instead of new `bytes`; returns the chunks' lengths (an exact Residual's vary with the data,
    each at most its header's bound). The bytes are exactly `to_chunks`'."""
    return _write(_payloads(enc, chunk_tokens, stream, request_tag), out)


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
    payloads = _payloads(enc, chunk_tokens, stream, request_tag)
    buf = bytearray(sum(HEADER.size + p.header.payload_len for p in payloads))
    lengths = _write(payloads, buf)
    chunks, pos = [], 0
    for n in lengths:
        chunks.append(bytes(buf[pos: pos + n]))
        pos += n
    return chunks


def wire_nbytes(enc: EncodedKV, chunk_tokens: int, *, stream: str) -> int:
    """Bytes the wire carries for `stream` of `enc` cut into chunks of `chunk_tokens` tokens:
    every chunk's header and payload, coded (what `to_chunks` returns, summed). Encodes to
    measure, since an exact Residual's coded size depends on the data."""
    return sum(len(c) for c in to_chunks(enc, chunk_tokens, stream=stream))

