"""The `tcp` backend's wire format: the data-connection preamble, the 40-byte frame header and
its checksums.

Owns the byte layouts and `parse_frame_header`, the check of every header a peer sends (untrusted
input). Used by the backend's connection setup (`tcp`, `tcp_accept`), its sender (`tcp_send`)
and its receivers (`tcp_recv`), and by the frame fuzz harness.

Preamble (first bytes of every data connection): magic u32, version u8, channel u8, session id
16 B, proof 32 B (`lynx_transport.auth.data_proof` of the channel with the session's data key).

Frame (little-endian, 40 bytes): magic u32 'LYNX', kind u8 (1 DATA, 2 FIN), stream u8, flags u16
(bit 0: CRC32 valid, bit 1: XXH3 valid; never both), request u64, region u32, checksum u32 (CRC32,
or the low 32 bits of XXH3-64 when both ends have `xxhash`: ~4x cheaper), offset u64 (DATA:
destination offset; FIN: total bytes of the stream), length u64 (payload bytes: DATA data, at most
MAX_CHUNK_BYTES; FIN aux, at most MAX_AUX_BYTES).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .backend import MAX_CHUNK_BYTES
from .types import MAX_AUX_BYTES, Stream

MAGIC = 0x584E594C  # b"LYNX" little-endian
HDR = struct.Struct("<IBBHQIIQQ")
assert HDR.size == 40
KIND_DATA, KIND_FIN = 1, 2
FLAG_CRC = 1
FLAG_XXH3 = 2
try:  # optional: a much cheaper checksum than zlib's CRC32, used when both ends have it
    import xxhash

    def xxh3_32(data) -> int:
        return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF

    CHECKSUMS = ["xxh3", "crc32"]
except ImportError:  # pragma: no cover - xxhash is a dependency; keep working without it
    xxh3_32 = None
    CHECKSUMS = ["crc32"]
PREAMBLE = struct.Struct("<IBB16s32s")  # magic, version, channel, session id, proof
DATA_VERSION = 2


class FrameError(ValueError):
    """A data frame header that breaks the protocol (`parse_frame_header`): the stream cannot be
    followed any more, so its session is closed (CORRUPTION)."""


@dataclass(frozen=True)
class FrameHeader:
    kind: int
    flags: int
    request_id: int
    region_id: int
    checksum: int
    offset: int  # DATA: destination offset; FIN: the stream's total bytes
    length: int  # payload bytes


def parse_frame_header(buf: bytes | bytearray | memoryview, stream: Stream) -> FrameHeader:
    """Check one frame header received on `stream`'s socket; FrameError if it is not one a
    sender of this protocol writes."""
    if len(buf) != HDR.size:
        raise FrameError(f"frame header of {len(buf)} B")
    magic, kind, fstream, flags, req, region, crc, offset, length = HDR.unpack(buf)
    if magic != MAGIC or fstream != int(stream):
        raise FrameError(f"bad frame header (magic {magic:#x}, stream {fstream} on the "
                         f"{stream.name} socket)")
    if kind == KIND_FIN:
        if flags != FLAG_CRC or region or length > MAX_AUX_BYTES:
            raise FrameError(f"bad FIN header (flags {flags}, region {region}, aux {length} B)")
    elif kind == KIND_DATA:
        if flags not in (0, FLAG_CRC, FLAG_XXH3):
            raise FrameError(f"bad DATA flags {flags:#x}")
        if length > MAX_CHUNK_BYTES or offset + length >= 1 << 64:
            raise FrameError(f"DATA chunk of {length} B at offset {offset}")
    else:
        raise FrameError(f"unknown frame kind {kind}")
    return FrameHeader(kind, flags, req, region, crc, offset, length)
