"""The last leg of the sending side: a run's wire chunks, encoded on the pool's device, into the
caller's host buffer (`PendingChunks`), their headers and checksums written once the payloads have
landed. Used by `wire_write.start_chunks` (and so by `fused.encode_run_start` and the prefill's
room writer, `lynx_sglang.backend.prefill.writer`).

A CPU run's payload pieces are copied into the buffer at once (`HostCopier`). A CUDA run's are
queued as asynchronous device-to-host copies on a side stream of the calling thread
(`CudaCopier`), which waits for the work queued so far on the thread's current stream (the
encode), so the call returns while the copies run and the caller can encode the next layer
meanwhile; into page-locked memory (a pinned staging buffer) the copies are true DMA, into
pageable memory the driver stages them and they complete before the call returns. One CRC pass
per chunk then runs on the host (`wire.crc32`: the C codec's where it is built).

Buffers: until `PendingChunks.finish` returns, the bytes of the caller's buffer that the chunks
cover are being written (by the copy engine) and must be neither read nor reused; the pending
object holds the device tensors it copies from until then. After it the buffer holds exactly
`wire_write.write_chunks`' bytes and nothing here refers to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .spec import CodecError
from .wire import HEADER, ChunkHeader, crc32

# Polling of a device event: from the first delay, doubled up to the last (a run's copy or a
# layer's write takes milliseconds; a late poll delays what waits by at most the last delay).
_POLL_FIRST_S = 20e-6
_POLL_LAST_S = 1e-3
# How long `finish` waits for the copies by default: a run's are milliseconds; a device that has
# not completed them in this long is broken, and the caller gets an error instead of a hang.
COPY_TIMEOUT_S = 60.0


class CopyEvent(Protocol):
    """What a pending copy needs of a device event (`torch.cuda.Event`'s interface)."""

    def query(self) -> bool:
        """Whether the copies queued before it have completed."""


class Copier(Protocol):
    """Moves payload pieces into a host buffer: `copy` for each piece, then `done` once."""

    def copy(self, piece: torch.Tensor, dst: np.ndarray) -> None:
        """Copy the 1-D uint8 `piece` into `dst` (a host view of the same length), now or
        queued."""

    def done(self) -> CopyEvent | None:
        """After the last `copy`: an event completed once every copy has landed, or None if they
        all have already."""


class HostCopier:
    """Pieces already in host memory (a CPU run): copied at once."""

    def copy(self, piece: torch.Tensor, dst: np.ndarray) -> None:
        dst[:] = piece.numpy()

    def done(self) -> None:
        return None


_copy_streams = threading.local()


class CudaCopier:
    """Pieces on a CUDA device: copied on the calling thread's side stream (one per thread and
    device, made on first use), after the work queued so far on its current stream."""

    def __init__(self, device: torch.device):
        streams = _copy_streams.__dict__.setdefault("by_device", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        self.stream = streams[device]
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.sources: list[torch.Tensor] = []

    def copy(self, piece: torch.Tensor, dst: np.ndarray) -> None:
        with torch.cuda.stream(self.stream):
            torch.from_numpy(dst).copy_(piece, non_blocking=True)
        # Until the copy has run: the caching allocator must not hand the piece's memory out.
        self.sources.append(piece)

    def done(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def copier_for(device: torch.device) -> Copier:
    if device.type == "cpu":
        return HostCopier()
    if device.type == "cuda":
        return CudaCopier(device)
    raise CodecError(f"no copy from a {device.type} device to host staging")


@dataclass(frozen=True)
class ChunkPieces:
    """One chunk to write: its header (payload_len set) and its payload's pieces in order, 1-D
    uint8 tensors on the run's device."""

    header: ChunkHeader
    pieces: Sequence[torch.Tensor]


class PendingChunks:
    """Chunks whose payloads are on their way into a host buffer; `finish` writes their headers
    and checksums once they have landed."""

    def __init__(self, chunks: Sequence[ChunkPieces], out, copier: Copier):
        buf = np.frombuffer(out, dtype=np.uint8)
        end = 0
        for c in chunks:  # every chunk checked before a byte is copied
            end += HEADER.size + c.header.payload_len
            if end > len(buf):
                raise CodecError(f"output buffer of {len(buf)} B is too small: chunk of tokens "
                                 f"[{c.header.token_start}, {c.header.token_end}) ends at byte "
                                 f"{end}")
        if not buf.flags.writeable:
            raise CodecError("output buffer is read-only")
        pos = 0
        for c in chunks:
            at = pos + HEADER.size
            for piece in c.pieces:
                copier.copy(piece, buf[at: at + piece.numel()])
                at += piece.numel()
            pos = at  # payload_len is the pieces' sum (wire_write._payloads)
        self._event = copier.done()
        self._copier = copier  # holds the device pieces until the copies have run
        self._headers = [c.header for c in chunks]
        self._buf = buf
        self._lengths: list[int] | None = None

    def finish(self, timeout_s: float = COPY_TIMEOUT_S) -> list[int]:
        """Once the payloads have landed (within `timeout_s`, else TimeoutError), write every
        chunk's header with its checksum; returns the chunks' lengths. Idempotent."""
        if self._lengths is not None:
            return self._lengths
        if self._event is not None:
            await_event(self._event, time.monotonic() + timeout_s,
                        f"the device-to-host copy of encoded chunks did not complete within "
                        f"{timeout_s:g} s")
            self._event = None
        self._copier = None
        buf, pos, lengths = self._buf, 0, []
        for header in self._headers:
            end = pos + HEADER.size + header.payload_len
            buf[pos: pos + HEADER.size] = np.frombuffer(header.pack(0), dtype=np.uint8)
            # crc32(header with 0 + payload) == wire._checksum(header, payload): one pass.
            crc = crc32(buf[pos: end])
            buf[pos: pos + HEADER.size] = np.frombuffer(header.pack(crc), dtype=np.uint8)
            lengths.append(end - pos)
            pos = end
        self._lengths = lengths
        return lengths


def wait_for_stream(device: torch.device, timeout_s: float = COPY_TIMEOUT_S) -> None:
    """Until the work queued so far on the calling thread's current stream of the CUDA `device`
    has run (TimeoutError after `timeout_s`: `synchronize` has no deadline)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    await_event(event, time.monotonic() + timeout_s,
                f"the device's queued work did not complete within {timeout_s:g} s")


def await_event(event: CopyEvent, deadline: float, timeout_message: str) -> None:
    """Poll `event.query()` until the device work before it has completed, from a short delay
    doubled up to 1 ms (a device event has no wait with a deadline: `synchronize` blocks for
    ever); TimeoutError(`timeout_message`) past `deadline` (`time.monotonic()`). Also the prefill's
    layer gate's wait for a layer's KV write (`lynx_sglang.backend.prefill.layer_stream`)."""
    delay = _POLL_FIRST_S
    while not event.query():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(timeout_message)
        time.sleep(min(delay, left))
        delay = min(2 * delay, _POLL_LAST_S)
