"""`RecvLoop`: the `tcp` backend's receiver thread of one socket (one stream of one session).

It reads a 40-byte header (`tcp_wire.parse_frame_header`: peer bytes, untrusted), asks the
Endpoint (`BackendHooks.open_incoming`) whether the write may land — before any payload byte is
read — and then `recv_into`s the payload directly into the destination region (or discards it
when refused), checking the chunk's checksum. Every read is bounded (SO_RCVTIMEO, or the TLS
socket's timeout: `io_timeout_s`) so the loop sees the session's stop flag.
Started by `tcp.TcpBackend` once a session's data connections are up; reports to `BackendHooks`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import zlib

from .backend import BackendHooks, Refused
from .tcp_session import TcpSession
from .tcp_wire import FLAG_CRC, FLAG_XXH3, HDR, KIND_FIN, FrameError, parse_frame_header, xxh3_32
from .types import FailureReason, Stream

log = logging.getLogger("lynx_transport.tcp")

# what a receiver's bounded read raises when no byte came in time: SO_RCVTIMEO (plain) or the
# socket timeout (TLS); the loop looks at its stop flag and reads again
_NO_BYTE_YET = (BlockingIOError, InterruptedError, TimeoutError, ssl.SSLWantReadError)


class RecvLoop:
    """The receiver thread of `stream` on one session (`run`); see the module docstring."""

    def __init__(self, ts: TcpSession, stream: Stream, hooks: BackendHooks, require_checksum: bool,
                 tls: bool):
        self.ts = ts
        self.stream = stream
        self.hooks = hooks
        self.require_checksum = require_checksum
        # TLS channels are read in chunks of TLS records (no MSG_WAITALL on an SSL socket)
        self.recv_flags = 0 if tls else socket.MSG_WAITALL

    def _recv_exact(self, sock: socket.socket, view: memoryview) -> bool:
        """Fill `view` from `sock`; False if the session is stopping. Raises on EOF."""
        got = 0
        n = len(view)
        while got < n:
            if self.ts.stop:
                return False
            try:
                k = sock.recv_into(view[got:], n - got, self.recv_flags)
            except _NO_BYTE_YET:
                continue
            if not k:
                raise ConnectionError("connection closed by peer")
            got += k
        return True

    def run(self) -> None:
        ts, stream = self.ts, self.stream
        try:
            self._frames()
        except ssl.SSLError as exc:  # before OSError, its base: say it was TLS
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.PEER_DIED,
                                        f"TLS on the {stream.name} connection: {exc}")
        except (ConnectionError, OSError) as exc:
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.PEER_DIED, str(exc))
        except FrameError as exc:
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.CORRUPTION, str(exc))
        except Exception as exc:  # pragma: no cover - bug
            log.exception("tcp receiver crashed")
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.LOCAL_ERROR, f"receiver: {exc!r}")

    def _frames(self) -> None:
        """Receive frames until the session stops; raises what ends the connection."""
        ts, stream = self.ts, self.stream
        sock = ts.rx[stream]
        hdr = bytearray(HDR.size)
        hview = memoryview(hdr)
        scratch = memoryview(bytearray(1 << 20))
        while not ts.stop:
            if not self._recv_exact(sock, hview):
                return
            h = parse_frame_header(hdr, stream)
            req, region, offset, length = h.request_id, h.region_id, h.offset, h.length
            if h.kind == KIND_FIN:
                aux = bytearray(length)
                if length and not self._recv_exact(sock, memoryview(aux)):
                    return
                ok = zlib.crc32(aux) == h.checksum
                self.hooks.incoming_fin(ts.sid, req, stream, offset, bytes(aux) if ok else None)
                continue
            try:
                w = self.hooks.open_incoming(ts.sid, req, stream, region, offset, length)
            except Refused:
                if not self._discard(sock, length, scratch):
                    return
                continue
            if self.require_checksum and not h.flags:
                # refused before a byte lands: a chunk nobody can verify
                if not self._discard(sock, length, scratch):
                    return
                w.finish(0, ok=False, reason=FailureReason.CORRUPTION,
                         detail=f"chunk at offset {offset} ({length} B) without a checksum: "
                                "this endpoint requires them")
                continue
            view = w.view
            got = 0
            diverted = False
            while got < length:
                if ts.stop:
                    return
                try:
                    # one bounded blocking read (≤ io_timeout_s) per guard
                    with w.guard() as ok:
                        if ok and not diverted:
                            k = sock.recv_into(view[got:], length - got, self.recv_flags)
                        else:
                            diverted = True
                            k = sock.recv_into(scratch, min(length - got, len(scratch)))
                except _NO_BYTE_YET:
                    continue
                if not k:
                    raise ConnectionError("connection closed by peer")
                got += k
            ts.recv_bytes[stream] += length
            if diverted:
                w.finish(0, ok=True)  # the stream already failed/released; nothing to add
            elif (h.flags & FLAG_XXH3 and (xxh3_32 is None or xxh3_32(view) != h.checksum)
                  ) or (h.flags & FLAG_CRC and zlib.crc32(view) != h.checksum):
                w.finish(length, ok=False, reason=FailureReason.CORRUPTION,
                         detail=f"checksum mismatch in chunk at offset {offset} "
                                f"({length} B) of region {region}")
            else:
                w.finish(length, ok=True)

    def _discard(self, sock: socket.socket, length: int, scratch: memoryview) -> bool:
        left = length
        while left:
            chunk = scratch[: min(left, len(scratch))]
            if not self._recv_exact(sock, chunk):
                return False
            left -= len(chunk)
        return True
