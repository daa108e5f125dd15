"""The sending side's copy into host staging (`lynx_kernels.chunk_copy`), run here without a GPU:
a stand-in copier that queues every payload piece and lands them only when the test says so, as
a CUDA copy stream does. What it protects: no header or checksum is written before the payloads
have landed (else a CRC over unlanded bytes would go on the wire), the bytes once landed are
exactly `to_chunks`' (test_fused: the C codec's), every wait has a deadline, and a buffer that cannot
hold the run is refused before anything is copied. `CudaCopier` itself runs on a device only
(`scripts/gpu_check.py`'s layer-streamed check goes through it)."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

from lynx_kernels import CodecError, CodecSpec, encode
from lynx_kernels.wire import HEADER, crc32, parse_chunk
from lynx_kernels.wire_write import start_chunks, to_chunks

CHUNK = 64


class HeldCopier:
    """Queues the pieces; `land` copies them, and only then does its event complete."""

    def __init__(self) -> None:
        self.queued: list[tuple[torch.Tensor, np.ndarray]] = []
        self.landed = threading.Event()

    def copy(self, piece: torch.Tensor, dst: np.ndarray) -> None:
        self.queued.append((piece.clone(), dst))

    def done(self) -> HeldCopier:
        return self

    def query(self) -> bool:
        return self.landed.is_set()

    def land(self) -> None:
        for piece, dst in self.queued:
            dst[:] = piece.numpy()
        self.landed.set()


def encoded(target: str, kind: str = "k", tokens: int = 200, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    kv = (torch.randn(tokens, 2, 64, generator=g) * 3).to(dtype)
    spec = CodecSpec(anchor_bits=4, group_size=64, target=target, sink_tokens=4,
                     recent_tokens=16, rotate=True)
    return encode(kv, spec, kind, layer=3, impl="torch")


@pytest.mark.parametrize("target,stream", [("exact", "anchor"), ("exact", "residual"),
                                           ("int8", "residual")])
def test_headers_are_written_only_once_the_payloads_have_landed(target, stream):
    enc = encoded(target)
    want = b"".join(to_chunks(enc, CHUNK, stream=stream, request_tag=9))
    out = bytearray(len(want) + 100)
    copier = HeldCopier()
    pending = start_chunks(enc, CHUNK, out, stream=stream, request_tag=9, copier=copier)
    assert len(copier.queued) >= 4 and not any(out), "wrote before the copies landed"
    finished: list[list[int]] = []
    waiter = threading.Thread(target=lambda: finished.append(pending.finish(10)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not any(out), "finished before the copies landed"
    copier.land()
    waiter.join(10)
    assert finished and sum(finished[0]) == len(want)
    assert bytes(out[: len(want)]) == want and not any(out[len(want):])
    for n in finished[0]:  # each a valid chunk: header and CRC over the landed payload
        parse_chunk(bytes(out[:n]))
        out = out[n:]
    assert pending.finish(10) == finished[0]  # idempotent


def test_a_copy_that_never_lands_times_out():
    enc = encoded("exact")
    out = bytearray(sum(len(c) for c in to_chunks(enc, CHUNK, stream="residual")))
    pending = start_chunks(enc, CHUNK, out, stream="residual", copier=HeldCopier())
    with pytest.raises(TimeoutError, match=r"did not complete within 0\.05 s"):
        pending.finish(0.05)
    assert not any(out)


def test_a_buffer_too_small_is_refused_before_any_copy():
    enc = encoded("int8", kind="v")
    need = sum(len(c) for c in to_chunks(enc, CHUNK, stream="anchor"))
    copier = HeldCopier()
    with pytest.raises(CodecError, match=f"output buffer of {need - 1} B is too small: chunk "
                                         r"of tokens \[192, 200\) ends at byte"):
        start_chunks(enc, CHUNK, bytearray(need - 1), stream="anchor", copier=copier)
    assert copier.queued == []
    with pytest.raises(CodecError, match="read-only"):
        start_chunks(enc, CHUNK, bytes(need), stream="anchor", copier=copier)


def test_the_checksum_is_zlibs_crc():
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert crc32(data) == zlib.crc32(data)
    head = data[:HEADER.size + 3].tobytes()
    assert crc32(memoryview(data)[7:], crc32(head)) == zlib.crc32(data[7:], zlib.crc32(head))
