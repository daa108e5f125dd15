"""`DataListener`: the `tcp` backend's data listener, where acceptors' data connections arrive.

It accepts connections, runs their TLS handshake (with a `TlsConfig`) and reads their preamble
(`tcp_wire.PREAMBLE`, peer bytes: untrusted), all in one selector thread for every session at once,
each connection under its own deadline (`preamble_timeout_s`) and within caps on connections whose
preamble is pending (`max_pending_preambles`, `..._per_peer`): a peer that trickles bytes or never
sends holds one slot for a bounded time and never delays anyone else. The caps never refuse a
newcomer: it makes room (`_make_room`). A candidate for eviction is first read once more, so a
connection whose preamble has arrived meanwhile (an honest burst: it sends its preamble with its
connect) is attached, not evicted; only a connection still incomplete is closed. Candidates come
first from addresses that have not completed a preamble within `KNOWN_PEER_S` (a completed one
proved a session's key), then the address holding the most, oldest first: idle connections from
any number of addresses cannot keep an honest session's data connections out. A known address
has no per-address cap (it proved it holds a session key; the overall cap still holds).

A complete preamble goes to the `attach` callable (`tcp.TcpBackend`), which checks its proof and
hands the connection to its session. When `accept` fails for want of resources (out of fds) the
listener stops watching its socket for `ACCEPT_BACKOFF_S` instead of spinning on it (its socket
stays readable while the kernel's queue holds the connection).

The accept path never dies of one connection: whatever fails while handling a connection closes
that connection only (`connection_errors`), and should the loop itself fail it is restarted
(`listener_restarts`, logged at ERROR) after `RESTART_BACKOFF_S`: new sessions keep connecting.
Owned and closed by `tcp.TcpBackend`.
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
# After the accept loop failed as a whole (a bug), the pause before it runs again: a loop that
# fails at once must not spin a core.
RESTART_BACKOFF_S = 0.05
# An address that completed a preamble (proved a session's data key) this recently is preferred
# to others when room must be made; at most KNOWN_PEERS addresses are remembered (least recent
# forgotten first), so the table's size does not depend on what peers do.
KNOWN_PEER_S = 600.0
KNOWN_PEERS = 4096
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
                         "tls_handshakes_failed": 0, "connection_errors": 0,
                         "listener_restarts": 0}  # written by the listener thread only
        # listener thread: address -> when it last completed a preamble (least recent first)
        self._known: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._resume_at: float | None = None  # listener thread: when to watch the socket again
        self.last_tls_failure = ""  # listener thread: why the last TLS handshake failed
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                         name=f"lynx-tcp-accept-{self.port}")
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it looks at its flag every `io_timeout_s`) and close the socket."""
        self._closed = True
        self._thread.join(5.0)
        with contextlib.suppress(OSError):
            self._sock.close()

    @property
    def alive(self) -> bool:
        """Whether the listener thread runs (it ends only on `close`)."""
        return self._thread.is_alive()

    def _serve(self) -> None:
        """The listener thread: the accept loop, run again if it fails as a whole (see the
        module docstring), until `close`."""
        while not self._closed:
            try:
                self._accept_loop()
            except Exception:  # a bug: keep serving new sessions, loudly
                self.counters["listener_restarts"] += 1
                log.exception("tcp data listener on port %d failed; restarted (%d so far)",
                              self.port, self.counters["listener_restarts"])
                time.sleep(RESTART_BACKOFF_S)

    def _accept_loop(self) -> None:
        """Accept data connections and read their preambles, each under its own deadline, for
        every session at once (one selector; no read here ever blocks)."""
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        self._resume_at = None
        pending: dict[socket.socket, _Pending] = {}
        try:
            while not self._closed:
                if self._resume_at is not None and time.monotonic() >= self._resume_at:
                    self._resume_at = None
                    sel.register(self._sock, selectors.EVENT_READ)
                for key, _ in sel.select(self.opts["io_timeout_s"]):
                    if key.fileobj is self._sock:
                        self._accept_new(sel, pending)
                        continue
                    # None: closed earlier in this batch (evicted, or read while making room)
                    p = pending.get(key.fileobj)
                    if p is not None:
                        self._guarded(sel, pending, p, self._read_preamble)
                t = time.monotonic()
                for p in [p for p in pending.values() if t > p.deadline]:
                    self.counters["preambles_expired"] += 1
                    self._drop(sel, pending, p)
        finally:
            for p in list(pending.values()):
                self._drop(sel, pending, p)
            sel.close()

    def _guarded(self, sel: selectors.BaseSelector, pending: dict, p: _Pending,
                 step: Callable[[selectors.BaseSelector, dict, _Pending], None]) -> None:
        """`step(sel, pending, p)`; if it fails, close `p` (and only `p`) and count it."""
        try:
            step(sel, pending, p)
        except Exception:
            self.counters["connection_errors"] += 1
            log.exception("tcp data listener: a connection from %s failed; closed", p.peer)
            self._drop(sel, pending, p)

    def _accept_new(self, sel: selectors.BaseSelector, pending: dict) -> None:
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
            try:
                self._admit(sel, pending, sock, addr[0])
            except Exception:  # this connection only; the loop goes on
                self.counters["connection_errors"] += 1
                log.exception("tcp data listener: admitting a connection from %s failed; closed",
                              addr[0])
                with contextlib.suppress(OSError):
                    sock.close()

    def _admit(self, sel: selectors.BaseSelector, pending: dict, sock: socket.socket,
               peer: str) -> None:
        """Make room for a newly accepted connection from `peer` (the caps never close the
        newcomer: idle connections from a few addresses would then hold every honest session's
        data connections out) and watch it for its preamble."""
        o = self.opts
        if (not self._is_known(peer) and sum(p.peer == peer for p in pending.values())
                >= o["max_pending_preambles_per_peer"]):
            self._make_room(sel, pending, peer)
        while len(pending) >= o["max_pending_preambles"]:
            self._make_room(sel, pending, None)
        sock.setblocking(False)
        if self._tls_server is not None:
            try:
                sock = self._tls_server.wrap_socket(sock, server_side=True,
                                                    do_handshake_on_connect=False)
            except OSError:
                sock.close()
                return
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
        if attached:
            self._remember(p.peer)
        else:
            self.counters["preambles_refused"] += 1
            with contextlib.suppress(OSError):
                p.sock.close()

    def _remember(self, peer: str) -> None:
        """`peer` completed a preamble that proved a session's key (see `KNOWN_PEER_S`)."""
        self._known.pop(peer, None)
        self._known[peer] = time.monotonic()
        while len(self._known) > KNOWN_PEERS:
            self._known.popitem(last=False)

    def _is_known(self, peer: str) -> bool:
        at = self._known.get(peer)
        return at is not None and time.monotonic() - at < KNOWN_PEER_S

    def _make_room(self, sel: selectors.BaseSelector, pending: dict, peer: str | None) -> None:
        """Free one pending slot: of address `peer`, or with None of any address. Each candidate
        (`_candidate`) is read once more first: if its preamble has arrived it leaves `pending`
        through `attach` (or its refusal) and nothing is evicted; else it is closed, evicted."""
        victim = self._candidate(pending, peer)
        if victim is None:
            return
        self._guarded(sel, pending, victim, self._read_preamble)
        if victim.sock in pending:
            self.counters["preambles_evicted"] += 1
            self._drop(sel, pending, victim)

    def _candidate(self, pending: dict, peer: str | None) -> _Pending | None:
        """The connection to make room with: the oldest of address `peer`; or with None, the
        oldest of the address holding the most among addresses not known (`_is_known`), and only
        if all are known, among all."""
        if peer is not None:
            return next((p for p in pending.values() if p.peer == peer), None)
        if not pending:
            return None
        unknown = [p for p in pending.values() if not self._is_known(p.peer)]
        pool = unknown or list(pending.values())
        held = collections.Counter(p.peer for p in pool)
        most = max(held.values())
        return next(p for p in pool if held[p.peer] == most)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, pending: dict, p: _Pending) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(p.sock)
        pending.pop(p.sock, None)
        with contextlib.suppress(OSError):
            p.sock.close()
