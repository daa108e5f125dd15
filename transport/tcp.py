"""`tcp` backend: one connection per stream per session (TLS: one per stream and direction).

`TcpBackend` is the `Backend` the Endpoint loads by the name "tcp"; it owns the sessions' data
paths (`tcp_session.TcpSession`) and composes the parts, each in its own module: the wire format
(`tcp_wire`), the data listener where the acceptor's connections arrive (`tcp_accept`), the
per-session sender thread (`tcp_send`) and the per-socket receiver threads (`tcp_recv`). It
dials the initiator's connections itself, checks each arriving preamble's proof, and queues,
drains and closes.

Data path per session: two TCP connections (ANCHOR, RESIDUAL), both opened by the initiator to the
acceptor's data listener and usable in both directions; with TLS (``options["tls"]``, a
`lynx_transport.tls.TlsConfig`) four, one per stream and direction (the TLS module's docstring says
why), each in TLS 1.3 with certificates checked both ways before its preamble is read. Each
connection opens with a preamble (magic, version, channel, session id, proof), the channel being
the stream (plain) or the stream + 2 × direction (TLS: 0 initiator → acceptor, 1 back), the proof
an HMAC of the channel with the session's data key (`lynx_transport.auth.data_proof`): only the
two ends of the authenticated handshake can attach a stream to a session.

Checksums: an endpoint with `checksum=True` (the default) refuses a DATA chunk without one (its
stream fails CORRUPTION, nothing lands) and says so in its `local_info`, so a sender checksums
every chunk for it whatever its own setting. FIN frames always carry the CRC32 of their aux bytes.

Priority: strict mode never hands RESIDUAL bytes to the kernel while ANCHOR work is queued; the
RESIDUAL socket has a small TCP_NOTSENT_LOWAT so that little RESIDUAL data waits unsent inside the
kernel when ANCHOR work arrives. With `PriorityPolicy.link_order` the session's `LinkOrder`
(`link_order`) may send a late request's RESIDUAL before newer requests' ANCHOR work, and the
ANCHOR socket gets a TCP_NOTSENT_LOWAT too (`LINK_ORDER_ANCHOR_LOWAT`); the receiver's WAITING
reaches that order through `waiting`. Sockets are marked with
IP_TOS / SO_PRIORITY per stream.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import ssl
import struct
import threading
import time

from .auth import data_proof
from .backend import Backend, BackendHooks, FinOp, PriorityPolicy, WriteOp
from .link_order import LinkOrder
from .memory import Region
from .tcp_accept import DataListener
from .tcp_recv import RecvLoop
from .tcp_send import QueuedOp, SendLoop
from .tcp_session import TcpSession
from .tcp_wire import CHECKSUMS, DATA_VERSION, MAGIC, PREAMBLE
from .tls import TlsConfig
from .types import STREAMS, FailureReason, HandshakeError, Stream

TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)
# PriorityPolicy.link_order: the ANCHOR socket's TCP_NOTSENT_LOWAT where `anchor_notsent_lowat`
# leaves the kernel's default. The order is decided chunk by chunk in the sender, so what the
# kernel already holds goes first whatever it decides: unbounded, a newer request's whole Anchor
# (MBs, autotuned send buffer) sat in the kernel ahead of a waiting Residual.
LINK_ORDER_ANCHOR_LOWAT = 256 * 1024

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
    # test-only fault injection: a tcp_send.CorruptChecksum the sender passes every DATA chunk's
    # checksum through (None = off)
    "_corrupt_checksum": None,
}


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
        self._channels = 4 if self.tls else 2
        self.hooks = hooks
        self.host = host
        self.policy = policy
        self.require_checksum = checksum
        self._sessions: dict[bytes, TcpSession] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._listener = DataListener(host, self.opts, self._tls_server, self._attach)
        self.port = self._listener.port

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
        ts = TcpSession(session_id, initiator, key,
                        order=LinkOrder() if self.policy.link_order else None)
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
                last = self._listener.last_tls_failure
                why = f"; the last TLS handshake on this data listener failed: {last}" if last else ""
                raise HandshakeError(
                    f"peer did not open data connections within {timeout} s{why}")
            if ts.stop:
                raise HandshakeError("session closed while connecting")

    def _dial(self, ts: TcpSession, host: str, port: int, channel: int,
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
        if anchor and not lowat and self.policy.link_order:
            lowat = LINK_ORDER_ANCHOR_LOWAT
        if lowat:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, int(lowat))
        if not anchor and o["residual_sndbuf"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(o["residual_sndbuf"]))
        elif o["sndbuf"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, int(o["sndbuf"]))
        if o["rcvbuf"]:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, int(o["rcvbuf"]))

    def _attach(self, sock: socket.socket, raw: bytes) -> bool:
        """Data listener thread: give a data connection with a complete preamble to its session;
        False if the preamble does not prove the session's key or the session cannot take it."""
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

    def _start_session(self, ts: TcpSession) -> None:
        io_timeout = self.opts["io_timeout_s"]
        if self.tls:
            # channel = stream + 2 * direction; direction 0 is written by the initiator
            mine, theirs = (0, 2) if ts.initiator else (2, 0)
            for s in STREAMS:
                ts.tx[s], ts.rx[s] = ts.socks[mine + int(s)], ts.socks[theirs + int(s)]
                # the sender never blocks (poll + SSL's WANT_WRITE); receivers wake every
                # io_timeout_s to look at their stop flag (a timeout before any byte is read)
                ts.tx[s].setblocking(False)
                ts.rx[s].settimeout(io_timeout)
        else:
            tv = struct.pack("ll", int(io_timeout), int((io_timeout % 1) * 1e6))
            for s in STREAMS:
                sock = ts.tx[s] = ts.rx[s] = ts.socks[int(s)]
                # Blocking sockets: receivers use MSG_WAITALL (one syscall per chunk) bounded by
                # SO_RCVTIMEO, so they still look at their stop flag every io_timeout_s; the
                # sender never blocks (MSG_DONTWAIT + poll).
                sock.setblocking(True)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        tag = ts.sid.hex()[:6]
        tls = self.tls is not None
        sender = SendLoop(ts, self.hooks, self.policy, self.opts, tls)
        ts.threads = [threading.Thread(target=sender.run, daemon=True, name=f"lynx-tcp-tx-{tag}")]
        for s in STREAMS:
            receiver = RecvLoop(ts, s, self.hooks, self.require_checksum, tls)
            ts.threads.append(threading.Thread(target=receiver.run, daemon=True,
                                               name=f"lynx-tcp-rx{int(s)}-{tag}"))
        for t in ts.threads:
            t.start()

    # ------------------------------------------------------------------ posting
    def post_write(self, op: WriteOp) -> None:
        self._post(op)

    def post_fin(self, op: FinOp) -> None:
        self._post(op)

    def _post(self, op: WriteOp | FinOp) -> None:
        ts = self._sessions.get(op.session_id)
        if ts is None or ts.stop:
            self.hooks.send_failed(op.session_id, op.request_id, op.stream, FailureReason.CLOSED,
                                   "tcp session not connected")
            return
        stream = Stream(op.stream)
        with ts.lock:
            ts.queues[stream].append(QueuedOp(op))
            if ts.order is not None:
                write = isinstance(op, WriteOp)
                ts.order.queued(op.request_id, stream, op.length if write else 0,
                                time.monotonic(), fin=not write, signalled=op.signalled)
        with contextlib.suppress(OSError):
            ts.wake_w.send(b"x")

    def waiting(self, session_id: bytes, request_id: int) -> None:
        ts = self._sessions.get(session_id)
        if ts is None or ts.order is None:
            return
        with ts.lock:
            changed = ts.order.waiting(request_id, time.monotonic())
        if changed:
            with contextlib.suppress(OSError):
                ts.wake_w.send(b"x")  # the sender chooses again now, not after its current wait

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
            if ts.order is not None:
                ts.order.drained(request_id, stream)
            while any(c is not None and c.request_id == request_id
                      and (stream is None or s == stream) for s, c in ts.current.items()):
                left = end - time.monotonic()
                if left <= 0 or ts.stop:
                    return ts.stop
                ts.lock.wait(min(left, 0.05))
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
        # the listener first: no connection attaches to a session while they close
        self._listener.close()
        for sid in list(self._sessions):
            self.session_close(sid)

    def listener_counters(self) -> dict[str, int]:
        """The data listener's event counts (`tcp_accept.DataListener.counters`), a copy."""
        return dict(self._listener.counters)

    def stats(self) -> dict:
        out: dict = {"sessions": len(self._sessions), **self._listener.counters}
        for sid, ts in list(self._sessions.items()):
            out[sid.hex()[:8]] = {
                "sent": {s.name: ts.sent_bytes[s] for s in STREAMS},
                "received": {s.name: ts.recv_bytes[s] for s in STREAMS},
            }
        return out
