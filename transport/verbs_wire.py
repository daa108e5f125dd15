"""The `verbs` backend's wire format: the notice a SEND carries behind each chunk's RDMA WRITE (DATA)
and at the end of a stream (FIN), and the work-request ids of its QPs.

Owns the notice layout and `parse_notice`, the check of every notice a peer sends (untrusted
input). Used by the backend's sender (`verbs_send`), its completion handling (`verbs_recv`), its
notice rings (`verbs_qp`), and by the frame fuzz harness and the host-side tests.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from .backend import MAX_CHUNK_BYTES
from .types import MAX_AUX_BYTES, Stream

# Notice on the wire (little endian): magic, kind, stream, has_crc, request id, region id,
# offset, length (FIN: total), crc32 (DATA: of the chunk; FIN: of the aux bytes that follow).
_NOTICE = struct.Struct("<4sBBBxQIQQI")
_MAGIC = b"LXV2"
DATA, FIN = 1, 2
SLOT_BYTES = _NOTICE.size + MAX_AUX_BYTES  # one notice buffer of a QP's ring
# wr_id layout: bits 62-63 kind, bits 32-33 lane, bits 0-31 slot.
WR_NOTICE, WR_WRITE, WR_PROBE, WR_RECV = 0, 1, 2, 3


def wr_id(kind: int, lane: int, slot: int) -> int:
    return (kind << 62) | (lane << 32) | slot


def split_wr_id(value: int) -> tuple[int, int, int]:
    """(kind, lane, slot) of a work request id made by `wr_id`."""
    return value >> 62, (value >> 32) & 3, value & 0xFFFFFFFF


class NoticeError(ValueError):
    """A notice that breaks the format (`parse_notice`): the session is failed (CORRUPTION)."""


@dataclass(frozen=True)
class Notice:
    """A parsed DATA or FIN notice. FIN: `aux` is None when it failed its CRC."""

    kind: int
    request_id: int
    region_id: int
    offset: int
    length: int  # DATA: the chunk's bytes; FIN: the stream's total
    has_crc: bool = False
    crc: int = 0
    aux: bytes | None = b""


def pack_data_notice(stream: Stream, request_id: int, region_id: int, offset: int, length: int,
                     crc: int | None) -> bytes:
    """The notice behind one chunk's RDMA WRITE (`crc` None: sent without a checksum)."""
    return _NOTICE.pack(_MAGIC, DATA, int(stream), crc is not None, request_id, region_id,
                        offset, length, crc or 0)


def pack_fin_notice(stream: Stream, request_id: int, total: int, aux: bytes) -> bytes:
    return _NOTICE.pack(_MAGIC, FIN, int(stream), 1, request_id, 0, 0, total,
                        zlib.crc32(aux)) + aux


def parse_notice(raw: bytes, stream: Stream) -> Notice:
    """Check a notice received on `stream`'s QP; NoticeError if no sender of this protocol would
    have sent it. A FIN whose aux fails its CRC parses, with `aux` None."""
    if len(raw) < _NOTICE.size:
        raise NoticeError(f"short notice ({len(raw)} B) on the {stream.name} QP")
    magic, kind, nstream, has_crc, rid, region, offset, length, crc = _NOTICE.unpack_from(raw)
    if magic != _MAGIC or nstream != int(stream) or has_crc > 1:
        raise NoticeError(f"malformed notice on the {stream.name} QP")
    tail = bytes(raw[_NOTICE.size:])
    if kind == DATA:
        if tail or length > MAX_CHUNK_BYTES or offset + length >= 1 << 64:
            raise NoticeError(f"malformed DATA notice on the {stream.name} QP")
        return Notice(DATA, rid, region, offset, length, bool(has_crc), crc)
    if kind == FIN and has_crc and not region and not offset and len(tail) <= MAX_AUX_BYTES:
        return Notice(FIN, rid, 0, 0, length, True, crc, tail if zlib.crc32(tail) == crc else None)
    raise NoticeError(f"malformed notice (kind {kind}) on the {stream.name} QP")
