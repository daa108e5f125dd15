"""The sending side of the wire format (`lynx_kernels.wire`): an `EncodedKV` cut into chunks by
token range, each a header and its payload (`to_chunks` as new `bytes`, `write_chunks` straight into
a caller's buffer, `start_chunks` the same with the device-to-host copy left running), and
`wire_nbytes`, what that puts on the wire. The format itself, and the receiving side
(`parse_chunk`, `assemble`), are in `wire`; the copy into host memory in `chunk_copy`.

Buffers: `to_chunks` returns new `bytes` objects owned by the caller (copy them into a transport
staging region and drop them); `write_chunks` fills a caller's buffer and keeps no reference;
`start_chunks` returns a `chunk_copy.PendingChunks`, and the buffer is the caller's again once its
`finish` has returned.
"""

from __future__ import annotations

import torch

from . import exact
from .chunk_copy import COPY_TIMEOUT_S, ChunkPieces, Copier, PendingChunks, copier_for
from .codec import EncodedKV, exact_parts
from .spec import CodecError, Target
from .wire import HEADER, ChunkHeader, WireStream, coded_rows, section_coder


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor's rows as a `[rows, row bytes]` uint8 tensor on its device, sharing its memory
    where it is contiguous."""
    row_bytes = t[0].numel() * t.element_size() if len(t) else 0
    return t.detach().contiguous().view(torch.uint8).reshape(len(t), row_bytes)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


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


def _payloads(enc: EncodedKV, chunk_tokens: int, stream: str, request_tag: int
              ) -> list[ChunkPieces]:
    """Every chunk of `stream` of the run, cut every `chunk_tokens` tokens, its pieces on the
    run's device."""
    wire_stream = _checked_stream(enc, chunk_tokens, stream, request_tag)
    chunks = list(_chunk_rows(enc, chunk_tokens))
    if wire_stream is WireStream.ANCHOR:
        sections = [(_byte_rows(enc.anchor), 0), (_byte_rows(enc.zero), 1),
                    (_byte_rows(enc.scale), 1), (_byte_rows(enc.protected), 2)]
        pieces = [([rows[ranges[which]].reshape(-1) for rows, which in sections], False)
                  for _, _, ranges in chunks]
    elif enc.spec.target is Target.INT8:
        rows = _byte_rows(enc.residual)
        pieces = [([rows[ranges[0]].reshape(-1)], False) for _, _, ranges in chunks]
    else:
        pieces = _exact_pieces(enc, chunks)
    payloads = []
    for (start, end, _), (parts, raw) in zip(chunks, pieces, strict=True):
        header = ChunkHeader(
            stream=wire_stream, spec=enc.spec, kind=enc.kind, dtype=enc.dtype, layer=enc.layer,
            num_heads=enc.num_heads, head_dim=enc.head_dim, request_tag=request_tag,
            total_tokens=enc.total_tokens, token_start=start, token_end=end,
            payload_len=sum(p.numel() for p in parts), raw=raw,
        )
        payloads.append(ChunkPieces(header, parts))
    return payloads


def _exact_pieces(enc: EncodedKV, chunks) -> list[tuple[list[torch.Tensor], bool]]:
    """Each chunk's exact Residual payload pieces and whether it is raw (see lynx_kernels.exact)."""
    coding = exact.CODINGS[enc.dtype]
    low, prediction = exact_parts(enc)
    kept = coded_rows(enc)
    x_bits = exact.value_bits(enc.residual).index_select(0, kept).reshape(-1)
    r_bits = exact.value_bits(prediction).index_select(0, kept).reshape(-1)
    e_s = exact.scale_exponents(enc.scale, enc.num_tokens, enc.num_heads, enc.head_dim,
                                enc.spec.group_size, enc.over_tokens, enc.spec.rotate)
    hd = enc.num_heads * enc.head_dim
    counts = [(rows.stop - rows.start - (prot.stop - prot.start)) * hd
              for _, _, (rows, _, prot) in chunks]
    encode_sections, _ = section_coder(enc.device)
    sections = encode_sections(
        exact.zigzag(exact.ordinal(x_bits, coding) - exact.ordinal(r_bits, coding)),
        exact.classes(r_bits, e_s.index_select(0, kept).reshape(-1), coding), x_bits, counts,
        coding)
    low_rows, value_rows = _byte_rows(low), _byte_rows(enc.residual)
    pieces = []
    for (_, _, (rows, _, _)), section in zip(chunks, sections, strict=True):
        coded = [low_rows[rows].reshape(-1), *(_flat(t) for t in section.parts())]
        raw = [value_rows[rows].reshape(-1)]
        if sum(p.numel() for p in coded) <= raw[0].numel():
            pieces.append((coded, False))
        else:
            pieces.append((raw, True))
    return pieces


def start_chunks(enc: EncodedKV, chunk_tokens: int, out, *, stream: str = "anchor",
                 request_tag: int = 0, copier: Copier | None = None) -> PendingChunks:
    """`write_chunks` with the device-to-host copy left running (a CUDA run's, see
    `chunk_copy`): `out` holds the chunks once the returned object's `finish` has returned.
    `copier`: how the payloads reach `out` (None: `chunk_copy.copier_for` the run's device)."""
    return PendingChunks(_payloads(enc, chunk_tokens, stream, request_tag), out,
                         copier or copier_for(enc.device))


def write_chunks(enc: EncodedKV, chunk_tokens: int, out, *, stream: str = "anchor",
                 request_tag: int = 0) -> list[int]:
    """`to_chunks` written back to back into the writable buffer `out` (a staging region, say)
    instead of new `bytes`; returns the chunks' lengths (an exact Residual's vary with the data,
    each at most its header's bound). The bytes are exactly `to_chunks`'."""
    return start_chunks(enc, chunk_tokens, out, stream=stream,
                        request_tag=request_tag).finish(COPY_TIMEOUT_S)


def _chunk_rows(enc: EncodedKV, chunk_tokens: int):
    """(start, end, `enc.rows(start, end)`) of each chunk."""
    for start in range(enc.token_start, enc.token_end, chunk_tokens):
        end = min(start + chunk_tokens, enc.token_end)
        yield start, end, enc.rows(start, end)


def to_chunks(enc: EncodedKV, chunk_tokens: int, *, stream: str = "anchor",
              request_tag: int = 0) -> list[bytes]:
    """Serialize `stream` ("anchor" or "residual") of `enc` as chunks of `chunk_tokens` tokens."""
    payloads = _payloads(enc, chunk_tokens, stream, request_tag)
    buf = bytearray(sum(HEADER.size + p.header.payload_len for p in payloads))
    lengths = PendingChunks(payloads, buf, copier_for(enc.device)).finish(COPY_TIMEOUT_S)
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

