"""SGLang's per-request aux data (first output token, its logprobs, ...) as it travels with the
Anchor's completion notice: `pack_aux` on the prefill, `unpack_aux` on the decode.

Layout: for each aux buffer in order, `<index u32><length u32><bytes>`.
"""

from __future__ import annotations

import struct

from ..errors import KVStreamError

_AUX_ITEM = struct.Struct("<II")


def pack_aux(items: list[bytes]) -> bytes:
    return b"".join(_AUX_ITEM.pack(i, len(data)) + data for i, data in enumerate(items))


def unpack_aux(blob: bytes) -> list[tuple[int, bytes]]:
    out = []
    pos = 0
    while pos < len(blob):
        if len(blob) - pos < _AUX_ITEM.size:
            raise KVStreamError("truncated aux data")
        index, n = _AUX_ITEM.unpack_from(blob, pos)
        pos += _AUX_ITEM.size
        if pos + n > len(blob):
            raise KVStreamError("truncated aux data")
        out.append((index, blob[pos: pos + n]))
        pos += n
    return out


def check_aux_items(items: list[tuple[int, bytes]], item_lens: list[int]) -> None:
    """Refuse aux items that do not fit this server's aux buffers (index out of range, or more
    bytes than a request's slot holds): they come from the peer, and SGLang's writer copies
    whatever length it is given."""
    for index, data in items:
        if not 0 <= index < len(item_lens):
            raise KVStreamError(f"aux item {index}: this decode has {len(item_lens)} aux buffers")
        if len(data) > item_lens[index]:
            raise KVStreamError(f"aux item {index} is {len(data)} B; its buffer holds "
                                f"{item_lens[index]} B per request")
