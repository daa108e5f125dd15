"""atheris harness: the data-path parsers — the tcp frame header (`lynx_transport.tcp_wire.
parse_frame_header`) and the verbs notice (`lynx_transport.verbs_wire.parse_notice`) — must raise
nothing but their documented errors (FrameError, NoticeError), and what they accept must respect
the caps a receiver relies on.

usage: python fuzz_frames.py [libFuzzer flags] [corpus dir ...]
An input is one byte (its low bit: the stream whose socket / QP it arrived on) and the frame;
fuzz_corpus/frames/ holds valid frames as seeds. test_fuzz.py runs it briefly.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["lynx_transport"]):
    from lynx_transport import tcp_wire, verbs_wire
    from lynx_transport.backend import MAX_CHUNK_BYTES
    from lynx_transport.types import MAX_AUX_BYTES, Stream


def check(data: bytes) -> None:
    if not data:
        return
    stream, body = Stream(data[0] & 1), data[1:]
    try:
        h = tcp_wire.parse_frame_header(body[:tcp_wire.HDR.size], stream)
    except tcp_wire.FrameError:
        pass
    else:
        if h.kind == tcp_wire.KIND_FIN:
            # a FIN's offset field is the stream's total, not a position bytes land at: any u64
            # is well-formed (a receiver refuses a total beyond what it announced)
            assert h.length <= MAX_AUX_BYTES
        else:
            assert h.length <= MAX_CHUNK_BYTES and h.offset + h.length < 1 << 64
    try:
        n = verbs_wire.parse_notice(body, stream)
    except verbs_wire.NoticeError:
        pass
    else:
        assert n.length <= MAX_CHUNK_BYTES or n.kind == 2
        assert n.aux is None or len(n.aux) <= MAX_AUX_BYTES


if __name__ == "__main__":
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
