"""atheris harness: decoding a control message (`lynx_transport.wire`: `decode`, `parse` with every
message's field checks, the HELLO and ANNOUNCE parsers) and checking its MAC must raise nothing but
`WireError`, whatever the bytes; a message that parses re-encodes to itself.

usage: python fuzz_control.py [libFuzzer flags] [corpus dir ...]
An input is a message's frames, each a u16 little-endian length and its bytes (`split`);
fuzz_corpus/control/ holds well-formed messages as seeds. test_fuzz.py runs it briefly.
"""

from __future__ import annotations

import struct
import sys

import atheris

with atheris.instrument_imports(include=["lynx_transport"]):
    from lynx_transport import auth, wire

KEYS = auth.SessionKeys.derive(b"a fuzzing secret", bytes(16), bytes(32), bytes(range(32)))


def split(data: bytes) -> list[bytes]:
    frames, i = [], 0
    while i + 2 <= len(data) and len(frames) < 6:
        (n,) = struct.unpack_from("<H", data, i)
        frames.append(data[i + 2:i + 2 + n])
        i += 2 + n
    return frames


def check(data: bytes) -> None:
    try:
        env = wire.decode(split(data))
    except wire.WireError:
        return
    auth.Channel(KEYS, initiator=False).check(env.signed, env.auth)
    try:
        message = wire.parse(env)
    except wire.WireError:
        return
    if message is None:
        return
    if isinstance(message, wire.Announce):
        ann = message.announcement()
        for stream, extents in ann.bounds.items():
            ann.stream_nbytes(stream)
            for e in extents:
                assert ann.find(stream, e.region_id, e.offset, e.length) is not None
    frames = wire.encode(message.KIND, env.sid, message.header(), message.payload)
    assert wire.parse(wire.decode(frames)) == message


if __name__ == "__main__":
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
