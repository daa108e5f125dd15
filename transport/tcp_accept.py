"""`DataListener`: the `tcp` backend's data listener, where acceptors' data connections arrive.

It accepts connections, runs their TLS handshake (with a `TlsConfig`) and reads their preamble
(`tcp_wire.PREAMBLE`, peer bytes: untrusted), all in one selector thread for every session at once,
each connection under its own deadline (`preamble_timeout_s`) and within caps on connections whose
preamble is pending (`max_pending_preambles`, `..._per_peer`): a peer that trickles bytes or never
sends holds one slot for a bounded time and never delays anyone else. The caps never refuse a
newcomer: it evicts an older pending connection (its own address's oldest when that address is at
its cap, else the oldest of the address holding the most), so idle connections from any number of
addresses cannot keep an honest session's data connections out (they send their preamble at
once). A complete preamble goes to the `attach` callable (`tcp.TcpBackend`), which checks its
proof and hands the connection to its session. When `accept` fails for want of resources (out of
fds) the listener stops watching its socket for `ACCEPT_BACKOFF_S` instead of spinning on it (its
socket stays readable while the kernel's queue holds the connection). Owned and closed by
`tcp.TcpBackend`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .tcp_wire import PREAMBLE

log = logging.getLogger("lynx_transport.tcp")

# How long the listener leaves its socket alone after `accept` failed for want of fds or memory.
ACCEPT_BACKOFF_S = 0.1
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


@dataclass
class _Pending:
    """A data connection whose preamble is still arriving (listener thread only)."""

    sock: socket.socket
    peer: str
    deadline: float
    buf: bytearray = field(default_factory=lambda: bytearray(PREAMBLE.size))
    got: int = 0
    handshaking: bool = False  # TLS: the handshake has not completed yet


class DataListener:
    """The listening socket and its selector thread (see the module docstring)."""

    def __init__(self, host: str, opts: dict, tls_server: ssl.SSLContext | None,
                 attach: Callable[[socket.socket, bytes], bool]):
        self.opts = opts
        self._tls_server = tls_server
        self._attach = attach
        self._closed = False
        self.counters = {"preambles_refused": 0, "preambles_expired": 0,
                         "preambles_evicted": 0, "accept_failed": 0,
                         "tls_handshakes_failed": 0}  # written by the listener thread only
        self._resume_at: float | None = None  # listener thread: when to watch the socket again
        self.last_tls_failure = ""  # listener thread: why the last TLS handshake failed
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                         name=f"lynx-tcp-accept-{self.port}")
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it looks at its flag every `io_timeout_s`) and close the socket."""
        self._closed = True
        self._thread.join(5.0)
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept_loop(self) -> None:
        """Accept data connections and read their preambles, each under its own deadline, for
        every session at once (one selector; no read here ever blocks)."""
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        pending: dict[socket.socket, _Pending] = {}
        try:
            while not self._closed:
                if self._resume_at is not None and time.monotonic() >= self._resume_at:
                    self._resume_at = None
                    sel.register(self._sock, selectors.EVENT_READ)
                for key, _ in sel.select(self.opts["io_timeout_s"]):
                    if key.fileobj is self._sock:
                        self._accept_new(sel, pending)
                    else:
                        self._read_preamble(sel, pending, pending[key.fileobj])
                t = time.monotonic()
                for p in [p for p in pending.values() if t > p.deadline]:
                    self.counters["preambles_expired"] += 1
                    self._drop(sel, pending, p)
        except Exception:  # pragma: no cover - a bug; new sessions can no longer connect
            log.exception("tcp data listener crashed")
        finally:
            for p in list(pending.values()):
                self._drop(sel, pending, p)
            sel.close()

    def _accept_new(self, sel: selectors.BaseSelector, pending: dict) -> None:
        o = self.opts
        for _ in range(64):  # then let the pending preambles have a turn
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.counters["accept_failed"] += 1
                log.debug("data listener accept failed: %s", exc)
                if exc.errno in _OUT_OF_RESOURCES:  # the socket stays readable: back off
                    sel.unregister(self._sock)
                    self._resume_at = time.monotonic() + ACCEPT_BACKOFF_S
                return
            peer = addr[0]
            # The caps never close the newcomer: idle connections from a few addresses would
            # then hold every honest session's data connections out. An honest preamble follows
            # its connect at once, so making room by dropping an older one costs honest peers
            # nothing.
            if sum(p.peer == peer for p in pending.values()) >= o["max_pending_preambles_per_peer"]:
                self._evict(sel, pending, peer)
            while len(pending) >= o["max_pending_preambles"]:
                self._evict(sel, pending, None)
            sock.setblocking(False)
            if self._tls_server is not None:
                try:
                    sock = self._tls_server.wrap_socket(sock, server_side=True,
                                                        do_handshake_on_connect=False)
                except OSError:
                    sock.close()
                    continue
            p = _Pending(sock, peer, time.monotonic() + o["preamble_timeout_s"],
                         handshaking=self._tls_server is not None)
            pending[sock] = p
            sel.register(sock, selectors.EVENT_READ)

    def _handshake(self, sel: selectors.BaseSelector, pending: dict, p: _Pending) -> bool:
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
            self.counters["tls_handshakes_failed"] += 1
            self.last_tls_failure = f"{p.peer}: {exc}"
            log.debug("TLS handshake from %s failed: %s", p.peer, exc)
            self._drop(sel, pending, p)
            return False
        p.handshaking = False
        sel.modify(p.sock, selectors.EVENT_READ)
        return True

    def _read_preamble(self, sel: selectors.BaseSelector, pending: dict, p: _Pending) -> None:
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
                self._drop(sel, pending, p)
                return
            p.got += n
            if p.got >= PREAMBLE.size:
                break
            # TLS may hold decrypted bytes the selector will not report again
            if not (self._tls_server is not None and p.sock.pending()):
                return
        sel.unregister(p.sock)
        del pending[p.sock]
        try:
            attached = self._attach(p.sock, bytes(p.buf))
        except OSError:  # e.g. reset while being configured: this connection only
            attached = False
        if not attached:
            self.counters["preambles_refused"] += 1
            with contextlib.suppress(OSError):
                p.sock.close()

    def _evict(self, sel: selectors.BaseSelector, pending: dict, peer: str | None) -> None:
        """Close one pending data connection: the oldest from address `peer`, or with None the
        oldest from the address holding the most."""
        if peer is None:
            held = collections.Counter(p.peer for p in pending.values())
            most = max(held.values())
            victim = next(p for p in pending.values() if held[p.peer] == most)
        else:
            victim = next(p for p in pending.values() if p.peer == peer)
        self.counters["preambles_evicted"] += 1
        self._drop(sel, pending, victim)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, pending: dict, p: _Pending) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(p.sock)
        pending.pop(p.sock, None)
        with contextlib.suppress(OSError):
            p.sock.close()
