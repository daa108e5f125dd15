"""`tcp` backend: one connection per stream per session (TLS: one per stream and direction).

Data path per session: two TCP connections (ANCHOR, RESIDUAL), both opened by the initiator to the
acceptor's data listener and usable in both directions; with TLS (``options["tls"]``, a
`lynx_transport.tls.TlsConfig`) four, one per stream and direction (the TLS module's docstring says
why), each in TLS 1.3 with certificates checked both ways before its preamble is read. One sender
thread per session owns every send: it picks the next chunk by `PriorityPolicy` and writes
`header + payload` with non-blocking `sendmsg` straight from the registered source memory (no
copy; with TLS an SSL write of at most `TLS_WRITE_BYTES`). One receiver thread per socket
reads a 40-byte header (`parse_frame_header`), asks the Endpoint (`open_incoming`) whether the
write may land — before any payload byte is read — and then `recv_into`s the payload directly into
the destination region (or discards it when refused).

Data connections: each opens with a preamble (magic, version, channel, session id, proof), the
channel being the stream (plain) or the stream + 2 × direction (TLS: 0 initiator → acceptor, 1
back), the proof an HMAC of the channel with the session's data key
(`lynx_transport.auth.data_proof`): only the two ends of the authenticated handshake can attach a
stream to a session. One listener thread reads every preamble through a selector, each under its
own deadline (`preamble_timeout_s`) and within caps on connections whose preamble is pending
(`max_pending_preambles`, `..._per_peer`): a peer that trickles bytes or never sends holds one
slot for a bounded time and never delays anyone else. The caps never refuse a newcomer: it
evicts an older pending connection (its own address's oldest when that address is at its cap,
else the oldest of the address holding the most), so idle connections from any number of
addresses cannot keep an honest session's data connections out (they send their preamble at
once). The TLS handshake runs in the same selector under the same deadline.

Checksums: an endpoint with `checksum=True` (the default) refuses a DATA chunk without one (its
stream fails CORRUPTION, nothing lands) and says so in its `local_info`, so a sender checksums
every chunk for it whatever its own setting. FIN frames always carry the CRC32 of their aux bytes.

Priority: strict mode never hands RESIDUAL bytes to the kernel while ANCHOR work is queued; the
RESIDUAL socket has a small TCP_NOTSENT_LOWAT so that little RESIDUAL data waits unsent inside the
kernel when ANCHOR work arrives. Sockets are marked with IP_TOS / SO_PRIORITY per stream.

Frame (little-endian, 40 bytes): magic u32 'LYNX', kind u8 (1 DATA, 2 FIN), stream u8, flags u16
(bit 0: CRC32 valid, bit 1: XXH3 valid; never both), request u64, region u32, checksum u32 (CRC32,
or the low 32 bits of XXH3-64 when both ends have `xxhash`: ~4x cheaper), offset u64 (DATA:
destination offset; FIN: total bytes of the stream), length u64 (payload bytes: DATA data, at most
MAX_CHUNK_BYTES; FIN aux, at most MAX_AUX_BYTES).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hmac
import logging
import select
import selectors
import socket
import ssl
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field

from .auth import data_proof
from .backend import MAX_CHUNK_BYTES, Backend, BackendHooks, FinOp, PriorityPolicy, Refused, WriteOp
from .memory import Region
from .tls import TlsConfig
from .types import MAX_AUX_BYTES, STREAMS, FailureReason, HandshakeError, Stream

log = logging.getLogger("lynx_transport.tcp")

MAGIC = 0x584E594C  # b"LYNX" little-endian
HDR = struct.Struct("<IBBHQIIQQ")
assert HDR.size == 40
KIND_DATA, KIND_FIN = 1, 2
FLAG_CRC = 1
FLAG_XXH3 = 2
try:  # optional: a much cheaper checksum than zlib's CRC32, used when both ends have it
    import xxhash

    def _xxh3_32(data) -> int:
        return xxhash.xxh3_64_intdigest(data) & 0xFFFFFFFF

    CHECKSUMS = ["xxh3", "crc32"]
except ImportError:  # pragma: no cover - xxhash is a dependency; keep working without it
    _xxh3_32 = None
    CHECKSUMS = ["crc32"]
PREAMBLE = struct.Struct("<IBB16s32s")  # magic, version, stream, session id, proof
DATA_VERSION = 2
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
SIOCOUTQ = 0x5411  # == TIOCOUTQ: bytes in a TCP socket's send queue not yet acknowledged
_OUTQ_BUF = bytes(4)
# TLS: bytes handed to one SSL write at most; OpenSSL must be given the same bytes again after a
# WANT_WRITE, and a bounded piece lets the sender return to its priority choice between pieces
TLS_WRITE_BYTES = 256 * 1024


# poll(2) events on which the sender tries a send: room, or an error the send will report
_SEND_READY = select.POLLOUT | select.POLLERR | select.POLLHUP | select.POLLNVAL

# what a receiver's bounded read raises when no byte came in time: SO_RCVTIMEO (plain) or the
# socket timeout (TLS); the loop looks at its stop flag and reads again
_NO_BYTE_YET = (BlockingIOError, InterruptedError, TimeoutError, ssl.SSLWantReadError)


def _outq(sock: socket.socket) -> int:
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCOUTQ, _OUTQ_BUF))[0]
    except OSError:
        return 0

DEFAULT_OPTIONS = {
    "anchor_tos": 0xB8,  # DSCP EF (46)
    "residual_tos": 0x20,  # DSCP CS1 (8, lower effort)
    "anchor_priority": 6,  # SO_PRIORITY (pfifo_fast band 0)
    "residual_priority": 1,  # SO_PRIORITY (pfifo_fast band 2)
    # unsent RESIDUAL bytes the kernel may hold: the socket polls writable below this and each
    # RESIDUAL send call hands over at most this much (so at most ~2x sit unsent)
    "residual_notsent_lowat": 128 * 1024,
    "anchor_notsent_lowat": 0,  # 0: leave the kernel default
    # strict mode: RESIDUAL also waits while the ANCHOR socket still holds more than this many
    # bytes not yet acknowledged by the peer (SIOCOUTQ); -1 disables. Without it a finished
    # ANCHOR's tail, still in the kernel, would share the link with the next RESIDUAL bytes.
    "anchor_hold_bytes": 0,
    # SO_SNDBUF of the RESIDUAL socket: caps RESIDUAL bytes in flight (sent, not yet acked) that
    # an ANCHOR arriving mid-RESIDUAL queues behind in the network. 0: kernel autotuning.
    "residual_sndbuf": 0,
    "sndbuf": 0,  # 0: kernel autotuning
    "rcvbuf": 0,
    "io_timeout_s": 0.2,  # how often blocked threads look at their stop flags
    # data connections whose preamble has not fully arrived: each is closed after this long, and
    # beyond these counts (in all, per peer address) a new one closes an older one: the oldest of
    # its own address when that address is at its cap, else the oldest of the address with most
    "preamble_timeout_s": 2.0,
    "max_pending_preambles": 64,
    "max_pending_preambles_per_peer": 16,
    "tls": None,  # a TlsConfig: every data connection in TLS 1.3, certificates checked both ways
    # test-only fault injection: limit the sender to this many bytes/s (0 = off)
    "_throttle_bps": 0,
}


@dataclass
class _Item:
    """One queued WriteOp (consumed chunk by chunk) or FinOp."""

    op: WriteOp | FinOp
    done: int = 0  # bytes of op already turned into chunks


@dataclass
class _Chunk:
    """A frame being sent on one socket: header + payload view, `pos` bytes already sent."""

    request_id: int
    bufs: list
    total: int
    payload: int
    pos: int = 0


@dataclass
class _TcpSession:
    sid: bytes
    initiator: bool
    key: bytes  # the session's data key: its data connections prove it
    socks: dict = field(default_factory=dict)  # channel (preamble) -> socket, every connection
    tx: dict = field(default_factory=dict)  # Stream -> the socket this end sends that stream on
    rx: dict = field(default_factory=dict)  # Stream -> the socket this end receives it on
    queues: dict = field(default_factory=lambda: {s: collections.deque() for s in STREAMS})
    current: dict = field(default_factory=lambda: {s: None for s in STREAMS})
    lock: threading.Condition = field(default_factory=threading.Condition)
    stop: bool = False
    threads: list = field(default_factory=list)
    wake_r: socket.socket | None = None
    wake_w: socket.socket | None = None
    connected: threading.Event = field(default_factory=threading.Event)
    sent_bytes: dict = field(default_factory=lambda: {s: 0 for s in STREAMS})
    recv_bytes: dict = field(default_factory=lambda: {s: 0 for s in STREAMS})
    corrupt_next: set = field(default_factory=set)  # test hook: streams whose next crc is wrong
    use_xxh3: bool = False
    peer_requires_checksum: bool = True  # what the peer's local_info says; until then: safe side


@dataclass
class _Preamble:
    """A data connection whose preamble is still arriving (listener thread only)."""

    sock: socket.socket
    peer: str
    deadline: float
    buf: bytearray = field(default_factory=lambda: bytearray(PREAMBLE.size))
    got: int = 0
    handshaking: bool = False  # TLS: the handshake has not completed yet


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


class TcpBackend(Backend):
    name = "tcp"
    counts_incoming = True

    def __init__(self, hooks: BackendHooks, host: str, policy: PriorityPolicy, options: dict,
                 checksum: bool = True):
        unknown = set(options) - set(DEFAULT_OPTIONS)
        if unknown:
            raise ValueError(f"unknown tcp backend options: {sorted(unknown)}")
        self.opts = {**DEFAULT_OPTIONS, **options}
        self.tls: TlsConfig | None = self.opts["tls"]
        if self.tls is not None and not isinstance(self.tls, TlsConfig):
            raise ValueError(f"tcp backend option tls must be a TlsConfig, got "
                             f"{type(self.tls).__name__}")
        # TlsConfigError (a ValueError naming the file) before any thread or socket exists
        self._tls_server, self._tls_client = self.tls.contexts() if self.tls else (None, None)
        # TLS channels carry one direction each, read in chunks of TLS records (no MSG_WAITALL
        # on an SSL socket)
        self._recv_flags = 0 if self.tls else socket.MSG_WAITALL
        self._channels = 4 if self.tls else 2
        self.hooks = hooks
        self.host = host
        self.policy = policy
        self.require_checksum = checksum
        self._sessions: dict[bytes, _TcpSession] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._counters = {"preambles_refused": 0, "preambles_expired": 0,
                          "preambles_evicted": 0,
                          "tls_handshakes_failed": 0}  # written by the listener thread only
        self._last_tls_failure = ""  # listener thread: why the last TLS handshake failed
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"lynx-tcp-accept-{self.port}")
        self._accept_thread.start()

    # ------------------------------------------------------------------ identity / memory
    def local_info(self) -> dict:
        return {"host": self.host, "port": self.port, "checksums": CHECKSUMS,
                "checksum_required": self.require_checksum, "tls": self.tls is not None}

    def register_region(self, region: Region) -> dict:
        region.view  # noqa: B018 - build the memoryview once, up front
        return {}

    def deregister_region(self, region: Region) -> None:
        region._view = None

    # ------------------------------------------------------------------ sessions
    def session_prepare(self, session_id: bytes, initiator: bool, key: bytes) -> dict:
        ts = _TcpSession(session_id, initiator, key)
        ts.wake_r, ts.wake_w = socket.socketpair()
        ts.wake_r.setblocking(False)
        ts.wake_w.setblocking(False)
        with self._lock:
            self._sessions[session_id] = ts
        return {}

    def session_connect(self, session_id, remote_info, remote_prepare, initiator, timeout):
        ts = self._sessions.get(session_id)
        if ts is None:
            raise HandshakeError("session not prepared")
        # what we send is verified by the peer: use XXH3 only if it can compute it too
        checksums = remote_info.get("checksums")
        ts.use_xxh3 = "xxh3" in CHECKSUMS and isinstance(checksums, list) and "xxh3" in checksums
        ts.peer_requires_checksum = remote_info.get("checksum_required") is not False
        peer_tls = remote_info.get("tls") is True
        if peer_tls != (self.tls is not None):
            # said by role, not "this"/"peer": the acceptor's text reaches the dialer too
            dialer_has = peer_tls != initiator
            raise HandshakeError(
                f"TLS differs on the tcp data connections: the "
                f"{'dialing' if dialer_has else 'accepting'} end has it, the "
                f"{'accepting' if dialer_has else 'dialing'} end does not (give both ends a "
                f"TlsConfig, or neither)")
        if initiator:
            host, port = remote_info.get("host"), remote_info.get("port")
            if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
                raise HandshakeError(f"bad tcp data address in the peer's info: {host!r}:{port!r}")
            for channel in range(self._channels):
                ts.socks[channel] = self._dial(ts, host, port, channel, timeout)
            self._start_session(ts)
        else:
            if not ts.connected.wait(timeout):
                why = (f"; the last TLS handshake on this data listener failed: "
                       f"{self._last_tls_failure}" if self._last_tls_failure else "")
                raise HandshakeError(
                    f"peer did not open data connections within {timeout} s{why}")
            if ts.stop:
                raise HandshakeError("session closed while connecting")

    def _dial(self, ts: _TcpSession, host: str, port: int, channel: int,
              timeout: float) -> socket.socket:
        """Initiator: one data connection of channel `channel`, TLS up and preamble sent."""
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self._configure(sock, Stream(channel & 1))
            sock.settimeout(timeout)
            preamble = PREAMBLE.pack(MAGIC, DATA_VERSION, channel, ts.sid,
                                     data_proof(ts.key, ts.sid, channel))
            if self._tls_client is None:
                sock.sendall(preamble)
                return sock
            try:
                sock = self._tls_client.wrap_socket(
                    sock, server_hostname=host if self.tls.check_hostname else None)
                sock.sendall(preamble)
            except ssl.SSLCertVerificationError as exc:
                raise HandshakeError(f"TLS to {host}:{port}: the peer's certificate was "
                                     f"refused: {exc.verify_message}") from None
            except OSError as exc:  # TLS 1.3: the peer's refusal of us comes after our handshake
                raise HandshakeError(f"TLS with {host}:{port} failed: {exc} (the peer may have "
                                     "refused this end's certificate)") from None
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return sock

    def _configure(self, sock: socket.socket, stream: Stream) -> None:
        o = self.opts
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        anchor = stream is Stream.ANCHOR
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS,
                            o["anchor_tos"] if anchor else o["residual_tos"])
        with contextlib.suppress(OSError):  # after IP_TOS, which also sets sk_priority
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY,
                            o["anchor_priority"] if anchor else o["residual_priority"])
        lowat = o["anchor_notsent_lowat"] if anchor else o["residual_notsent_lowat"]
        if lowat:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, int(lowat))
        if not anchor and o["residual_sndbuf"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(o["residual_sndbuf"]))
        elif o["sndbuf"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(o["sndbuf"]))
        if o["rcvbuf"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(o["rcvbuf"]))

    # ------------------------------------------------------------------ data listener
    def _accept_loop(self) -> None:
        """Accept data connections and read their preambles, each under its own deadline, for
        every session at once (one selector; no read here ever blocks)."""
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        pending: dict[socket.socket, _Preamble] = {}
        try:
            while not self._closed:
                for key, _ in sel.select(self.opts["io_timeout_s"]):
                    if key.fileobj is self._listener:
                        self._accept_new(sel, pending)
                    else:
                        self._read_preamble(sel, pending, pending[key.fileobj])
                t = time.monotonic()
                for p in [p for p in pending.values() if t > p.deadline]:
                    self._counters["preambles_expired"] += 1
                    self._drop_preamble(sel, pending, p)
        except Exception:  # pragma: no cover - a bug; new sessions can no longer connect
            log.exception("tcp data listener crashed")
        finally:
            for p in list(pending.values()):
                self._drop_preamble(sel, pending, p)
            sel.close()

    def _accept_new(self, sel: selectors.BaseSelector, pending: dict) -> None:
        o = self.opts
        for _ in range(64):  # then let the pending preambles have a turn
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of fds: refuse until some close
                log.debug("data listener accept failed: %s", exc)
                return
            peer = addr[0]
            # The caps never close the newcomer: idle connections from a few addresses would
            # then hold every honest session's data connections out. An honest preamble follows
            # its connect at once, so making room by dropping an older one costs honest peers
            # nothing.
            if sum(p.peer == peer for p in pending.values()) >= o["max_pending_preambles_per_peer"]:
                self._evict_preamble(sel, pending, peer)
            while len(pending) >= o["max_pending_preambles"]:
                self._evict_preamble(sel, pending, None)
            sock.setblocking(False)
            if self._tls_server is not None:
                try:
                    sock = self._tls_server.wrap_socket(sock, server_side=True,
                                                        do_handshake_on_connect=False)
                except OSError:
                    sock.close()
                    continue
            p = _Preamble(sock, peer, time.monotonic() + o["preamble_timeout_s"],
                          handshaking=self._tls_server is not None)
            pending[sock] = p
            sel.register(sock, selectors.EVENT_READ)

    def _handshake(self, sel: selectors.BaseSelector, pending: dict, p: _Preamble) -> bool:
        """TLS: advance `p`'s handshake; True once it is complete."""
        try:
            p.sock.do_handshake()
        except ssl.SSLWantReadError:
            sel.modify(p.sock, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            sel.modify(p.sock, selectors.EVENT_WRITE)
            return False
        except OSError as exc:
            self._counters["tls_handshakes_failed"] += 1
            self._last_tls_failure = f"{p.peer}: {exc}"
            log.debug("TLS handshake from %s failed: %s", p.peer, exc)
            self._drop_preamble(sel, pending, p)
            return False
        p.handshaking = False
        sel.modify(p.sock, selectors.EVENT_READ)
        return True

    def _read_preamble(self, sel: selectors.BaseSelector, pending: dict, p: _Preamble) -> None:
        if p.handshaking and not self._handshake(sel, pending, p):
            return
        while True:
            try:
                n = p.sock.recv_into(memoryview(p.buf)[p.got:])
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:
                n = 0
            if not n:
                self._drop_preamble(sel, pending, p)
                return
            p.got += n
            if p.got >= PREAMBLE.size:
                break
            # TLS may hold decrypted bytes the selector will not report again
            if not (self.tls and p.sock.pending()):
                return
        sel.unregister(p.sock)
        del pending[p.sock]
        try:
            attached = self._attach(p.sock, bytes(p.buf))
        except OSError:  # e.g. reset while being configured: this connection only
            attached = False
        if not attached:
            self._counters["preambles_refused"] += 1
            with contextlib.suppress(OSError):
                p.sock.close()

    def _evict_preamble(self, sel: selectors.BaseSelector, pending: dict, peer: str | None) -> None:
        """Close one pending data connection: the oldest from address `peer`, or with None the
        oldest from the address holding the most."""
        if peer is None:
            held = collections.Counter(p.peer for p in pending.values())
            most = max(held.values())
            victim = next(p for p in pending.values() if held[p.peer] == most)
        else:
            victim = next(p for p in pending.values() if p.peer == peer)
        self._counters["preambles_evicted"] += 1
        self._drop_preamble(sel, pending, victim)

    @staticmethod
    def _drop_preamble(sel: selectors.BaseSelector, pending: dict, p: _Preamble) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(p.sock)
        pending.pop(p.sock, None)
        with contextlib.suppress(OSError):
            p.sock.close()

    def _attach(self, sock: socket.socket, raw: bytes) -> bool:
        """Give a data connection with a complete preamble to its session; False if the preamble
        does not prove the session's key or the session cannot take it."""
        magic, version, channel, sid, proof = PREAMBLE.unpack(raw)
        ts = self._sessions.get(sid)
        if (magic != MAGIC or version != DATA_VERSION or not 0 <= channel < self._channels
                or ts is None or ts.initiator
                or not hmac.compare_digest(proof, data_proof(ts.key, sid, channel))):
            return False
        sock.setblocking(True)
        self._configure(sock, Stream(channel & 1))
        with ts.lock:
            if channel in ts.socks or ts.stop:
                return False
            ts.socks[channel] = sock
            both = len(ts.socks) == self._channels
        if both:
            self._start_session(ts)
            ts.connected.set()
        return True

    def _start_session(self, ts: _TcpSession) -> None:
        io_timeout = self.opts["io_timeout_s"]
        if self.tls:
            # channel = stream + 2 * direction; direction 0 is written by the initiator
            mine, theirs = (0, 2) if ts.initiator else (2, 0)
            for s in STREAMS:
                ts.tx[s], ts.rx[s] = ts.socks[mine + int(s)], ts.socks[theirs + int(s)]
                # the sender never blocks (select + SSL's WANT_WRITE); receivers wake every
                # io_timeout_s to look at their stop flag (a timeout before any byte is read)
                ts.tx[s].setblocking(False)
                ts.rx[s].settimeout(io_timeout)
        else:
            tv = struct.pack("ll", int(io_timeout), int((io_timeout % 1) * 1e6))
            for s in STREAMS:
                sock = ts.tx[s] = ts.rx[s] = ts.socks[int(s)]
                # Blocking sockets: receivers use MSG_WAITALL (one syscall per chunk) bounded by
                # SO_RCVTIMEO, so they still look at their stop flag every io_timeout_s; the
                # sender never blocks (MSG_DONTWAIT + select).
                sock.setblocking(True)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        tag = ts.sid.hex()[:6]
        ts.threads = [threading.Thread(target=self._send_loop, args=(ts,), daemon=True,
                                       name=f"lynx-tcp-tx-{tag}")]
        for s in STREAMS:
            ts.threads.append(threading.Thread(target=self._recv_loop, args=(ts, s), daemon=True,
                                               name=f"lynx-tcp-rx{int(s)}-{tag}"))
        for t in ts.threads:
            t.start()

    # ------------------------------------------------------------------ posting
    def _session(self, sid: bytes) -> _TcpSession | None:
        ts = self._sessions.get(sid)
        return None if ts is None or ts.stop else ts

    def post_write(self, op: WriteOp) -> None:
        self._post(op.session_id, op.stream, _Item(op), op)

    def post_fin(self, op: FinOp) -> None:
        self._post(op.session_id, op.stream, _Item(op), op)

    def _post(self, sid, stream, item, op) -> None:
        ts = self._session(sid)
        if ts is None:
            self.hooks.send_failed(sid, op.request_id, stream, FailureReason.CLOSED,
                                   "tcp session not connected")
            return
        with ts.lock:
            ts.queues[Stream(stream)].append(item)
        with contextlib.suppress(OSError):
            ts.wake_w.send(b"x")

    def drain(self, session_id: bytes, request_id: int, timeout: float,
              stream: Stream | None = None) -> bool:
        ts = self._sessions.get(session_id)
        if ts is None:
            return True
        end = time.monotonic() + timeout
        with ts.lock:
            for s, q in ts.queues.items():
                if stream is not None and s != stream:
                    continue
                keep = [it for it in q if it.op.request_id != request_id]
                q.clear()
                q.extend(keep)
            while any(c is not None and c.request_id == request_id
                      and (stream is None or s == stream) for s, c in ts.current.items()):
                left = end - time.monotonic()
                if left <= 0 or ts.stop:
                    return ts.stop
                ts.lock.wait(min(left, 0.05))
        return True

    def inject_corruption(self, session_id: bytes, stream: Stream) -> None:
        """Test hook: the next DATA chunk sent on `stream` carries a wrong CRC."""
        ts = self._sessions[session_id]
        with ts.lock:
            ts.corrupt_next.add(Stream(stream))

    # ------------------------------------------------------------------ sender thread
    def _next_chunk(self, ts: _TcpSession, stream: Stream) -> _Chunk | None:
        """Turn the head of `stream`'s queue into a frame (called with ts.lock held)."""
        q = ts.queues[stream]
        while q:
            item = q[0]
            op = item.op
            if isinstance(op, FinOp):
                q.popleft()
                aux = op.aux
                hdr = HDR.pack(MAGIC, KIND_FIN, int(stream), FLAG_CRC, op.request_id, 0,
                               zlib.crc32(aux), op.total, len(aux))
                return _Chunk(op.request_id, [hdr, aux] if aux else [hdr], len(hdr) + len(aux), 0)
            n = min(self.policy.chunk_bytes, op.length - item.done)
            view = op.src.slice(op.src_offset + item.done, n)
            flags = 0
            crc = 0
            if op.checksum or ts.peer_requires_checksum:
                if ts.use_xxh3:
                    flags = FLAG_XXH3
                    crc = _xxh3_32(view)
                else:
                    flags = FLAG_CRC
                    crc = zlib.crc32(view)
                if stream in ts.corrupt_next:
                    ts.corrupt_next.discard(stream)
                    crc ^= 0x5A5A5A5A
            hdr = HDR.pack(MAGIC, KIND_DATA, int(stream), flags, op.request_id, op.dst_region_id,
                           crc, op.dst_offset + item.done, n)
            item.done += n
            if item.done >= op.length:
                q.popleft()
            return _Chunk(op.request_id, [hdr, view], len(hdr) + n, n)
        return None

    def _has_work(self, ts: _TcpSession, s: Stream) -> bool:
        return ts.current[s] is not None or bool(ts.queues[s])

    def _send_loop(self, ts: _TcpSession) -> None:
        A, R = Stream.ANCHOR, Stream.RESIDUAL
        strict = self.policy.mode == "strict"
        share = self.policy.residual_share
        weight_sent = {A: 0.0, R: 0.0}  # bytes / share, for weighted mode
        throttle = float(self.opts["_throttle_bps"] or 0)
        next_ok = time.monotonic()
        io_timeout = self.opts["io_timeout_s"]
        res_cap = int(self.opts["residual_notsent_lowat"] or 0)
        hold = int(self.opts["anchor_hold_bytes"])
        try:
            while not ts.stop:
                with ts.lock:
                    has = {s: self._has_work(ts, s) for s in STREAMS}
                if not has[A] and not has[R]:
                    self._wait_wake(ts, io_timeout)
                    continue
                if strict:
                    order = [A] if has[A] else [R]
                    if not has[A] and hold >= 0 and _outq(ts.tx[A]) > hold:
                        # the ANCHOR's tail is still in the kernel / on the wire: keep the link
                        self._wait_wake(ts, 0.0005)
                        continue
                else:
                    cands = [s for s in STREAMS if has[s]]
                    order = sorted(cands, key=lambda s: weight_sent[s])
                if throttle:
                    delay = next_ok - time.monotonic()
                    if delay > 0:
                        time.sleep(min(delay, io_timeout))
                        continue
                if strict and order[0] is A:
                    # ANCHOR: just try (no poll syscall); wait for room only when the kernel
                    # says the socket is full
                    stream = A
                elif (stream := self._wait_writable(ts, order, io_timeout)) is None:
                    # RESIDUAL (and weighted mode) go through poll, which honours
                    # TCP_NOTSENT_LOWAT: a plain send would fill the whole send buffer
                    continue
                with ts.lock:
                    ch = ts.current[stream]
                    if ch is None:
                        ch = ts.current[stream] = self._next_chunk(ts, stream)
                    if ch is None:
                        continue
                limit = 65536 if throttle else (res_cap if stream is R else 0)
                sent = self._send_some(ts.tx[stream], ch, limit)
                if sent is None:
                    if stream is A and strict:
                        self._wait_writable(ts, [A], io_timeout)
                    continue
                ch.pos += sent
                ts.sent_bytes[stream] += sent
                if throttle:
                    next_ok = max(next_ok, time.monotonic()) + sent / throttle
                if not strict:
                    weight_sent[stream] += sent / (share if stream is R else 1.0 - share)
                    low = min(weight_sent.values())
                    for s in STREAMS:  # forget history while a stream is idle
                        weight_sent[s] = weight_sent[s] - low if has[s] else 0.0
                if ch.pos >= ch.total:
                    with ts.lock:
                        ts.current[stream] = None
                        ts.lock.notify_all()
                    if ch.payload:
                        self.hooks.sent(ts.sid, ch.request_id, stream, ch.payload)
        except (ConnectionError, OSError) as exc:
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.PEER_DIED, f"send failed: {exc}")
        except Exception as exc:  # pragma: no cover - bug
            log.exception("tcp sender crashed")
            if not ts.stop:
                self.hooks.session_lost(ts.sid, FailureReason.LOCAL_ERROR, f"sender: {exc!r}")
        finally:
            with ts.lock:
                ts.current = {s: None for s in STREAMS}
                ts.lock.notify_all()

    @staticmethod
    def _clear_wake(ts: _TcpSession) -> None:
        with contextlib.suppress(OSError):
            while ts.wake_r.recv(4096):
                pass

    def _wait_wake(self, ts: _TcpSession, timeout: float) -> None:
        self._wait_writable(ts, [], timeout)

    def _wait_writable(self, ts: _TcpSession, order: list, timeout: float) -> Stream | None:
        """First stream of `order` whose socket polls writable within `timeout`, else None; a
        wake-up (new work) ends the wait early. poll(2), not select(2): select refuses any fd
        above 1023, which a process with many sessions or files open reaches. poll's timeout is
        whole milliseconds (rounded up), so the sender's short waits last at least 1 ms."""
        poller = select.poll()
        poller.register(ts.wake_r, select.POLLIN)
        fds = {ts.tx[s].fileno(): s for s in order}
        for fd in fds:
            poller.register(fd, select.POLLOUT)
        ready = dict(poller.poll(timeout * 1000))
        if ts.wake_r.fileno() in ready:
            self._clear_wake(ts)
        # an error counts as writable (as in select): the send then raises and says what it is
        return next((s for fd, s in fds.items() if ready.get(fd, 0) & _SEND_READY), None)

    def _send_some(self, sock: socket.socket, ch: _Chunk, limit: int) -> int | None:
        pos = ch.pos
        bufs = []
        for b in ch.bufs:
            n = len(b)
            if pos >= n:
                pos -= n
                continue
            bufs.append(memoryview(b)[pos:] if pos else b)
            pos = 0
        if self.tls:
            # one piece per call, the same piece again after a WANT_WRITE (ch.pos and limit
            # are unchanged then), as OpenSSL requires; an SSL write is all or WANT_WRITE
            piece = memoryview(bufs[0])[: limit or TLS_WRITE_BYTES]
            try:
                return sock.send(piece)
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError,
                    InterruptedError):
                return None
        if limit:
            total = 0
            cut = []
            for b in bufs:
                take = min(len(b), limit - total)
                cut.append(memoryview(b)[:take])
                total += take
                if total >= limit:
                    break
            bufs = cut
        try:
            return sock.sendmsg(bufs, (), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None

    # ------------------------------------------------------------------ receiver threads
    def _recv_exact(self, ts: _TcpSession, sock: socket.socket, view: memoryview) -> bool:
        """Fill `view` from `sock`; False if the session is stopping. Raises on EOF."""
        got = 0
        n = len(view)
        while got < n:
            if ts.stop:
                return False
            try:
                k = sock.recv_into(view[got:], n - got, self._recv_flags)
            except _NO_BYTE_YET:
                continue
            if not k:
                raise ConnectionError("connection closed by peer")
            got += k
        return True

    def _recv_loop(self, ts: _TcpSession, stream: Stream) -> None:
        sock = ts.rx[stream]
        hdr = bytearray(HDR.size)
        hview = memoryview(hdr)
        scratch = memoryview(bytearray(1 << 20))
        try:
            while not ts.stop:
                if not self._recv_exact(ts, sock, hview):
                    return
                h = parse_frame_header(hdr, stream)
                req, region, offset, length = h.request_id, h.region_id, h.offset, h.length
                if h.kind == KIND_FIN:
                    aux = bytearray(length)
                    if length and not self._recv_exact(ts, sock, memoryview(aux)):
                        return
                    ok = zlib.crc32(aux) == h.checksum
                    self.hooks.incoming_fin(ts.sid, req, stream, offset,
                                            bytes(aux) if ok else None)
                    continue
                try:
                    w = self.hooks.open_incoming(ts.sid, req, stream, region, offset, length)
                except Refused:
                    if not self._discard(ts, sock, length, scratch):
                        return
                    continue
                if self.require_checksum and not h.flags:
                    # refused before a byte lands: a chunk nobody can verify
                    if not self._discard(ts, sock, length, scratch):
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
                                k = sock.recv_into(view[got:], length - got, self._recv_flags)
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
                elif (h.flags & FLAG_XXH3 and (_xxh3_32 is None or _xxh3_32(view) != h.checksum)
                      ) or (h.flags & FLAG_CRC and zlib.crc32(view) != h.checksum):
                    w.finish(length, ok=False, reason=FailureReason.CORRUPTION,
                             detail=f"checksum mismatch in chunk at offset {offset} "
                                    f"({length} B) of region {region}")
                else:
                    w.finish(length, ok=True)
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

    def _discard(self, ts, sock, length, scratch) -> bool:
        left = length
        while left:
            chunk = scratch[: min(left, len(scratch))]
            if not self._recv_exact(ts, sock, chunk):
                return False
            left -= len(chunk)
        return True

    # ------------------------------------------------------------------ teardown
    def session_close(self, session_id: bytes) -> None:
        with self._lock:
            ts = self._sessions.pop(session_id, None)
        if ts is None:
            return
        with ts.lock:
            ts.stop = True
            ts.lock.notify_all()
        for sock in ts.socks.values():
            with contextlib.suppress(OSError):
                # the plain socket's shutdown: SSLSocket.shutdown would drop the SSL object
                # under a receiver thread that is still reading through it
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            ts.wake_w.send(b"x")
        ts.connected.set()
        me = threading.current_thread()
        for t in ts.threads:
            if t is not me:
                t.join(5.0)
        for sock in ts.socks.values():
            with contextlib.suppress(OSError):
                sock.close()
        for sock in (ts.wake_r, ts.wake_w):
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sid in list(self._sessions):
            self.session_close(sid)
        self._accept_thread.join(5.0)
        with contextlib.suppress(OSError):
            self._listener.close()

    def stats(self) -> dict:
        out: dict = {"sessions": len(self._sessions), **self._counters}
        for sid, ts in list(self._sessions.items()):
            out[sid.hex()[:8]] = {
                "sent": {s.name: ts.sent_bytes[s] for s in STREAMS},
                "received": {s.name: ts.recv_bytes[s] for s in STREAMS},
            }
        return out

