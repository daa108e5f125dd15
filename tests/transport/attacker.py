"""Hostile peers for the regression tests of test_hostile_peer.py and test_hostile_load.py: a raw
zmq DEALER that sends whatever frames it is told to an Endpoint's control address (given the
secret, it passes the control connections' CURVE layer as an insider would), a raw ZMTP client
(below pyzmq, to send frame headers no zmq library would), a fake acceptor that records what a
real initiator sends, and raw TCP connections to a tcp data listener. Each speaks just enough of
the protocol to attack; none uses lynx_transport's own sockets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq
from zmq.utils import z85

from lynx_transport.auth import NONCE_BYTES, control_key
from lynx_transport.wire import PROTOCOL_VERSION


def resources() -> tuple[int, int]:
    """(threads, open file descriptors) of this process."""
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def frames(kind: str, sid: bytes, header: dict, payload: bytes = b"") -> list[bytes]:
    return [kind.encode(), json.dumps({"sid": sid.hex(), **header}).encode(), payload]


def hello(sid: bytes | None = None, **override) -> list[bytes]:
    """A well-formed HELLO (fields replaced by `override`)."""
    header = {"version": PROTOCOL_VERSION, "backend": "tcp", "endpoint": "evil",
              "address": "tcp://evil:1", "nonce": os.urandom(NONCE_BYTES).hex(), **override}
    return frames("HELLO", sid or os.urandom(16), header)


def curve_server_key(secret: bytes) -> bytes:
    """The public CURVE key (z85) of the control planes of a deployment with `secret`."""
    return zmq.curve_public(z85.encode(control_key(secret)))


class RawPeer:
    """A zmq DEALER connected to `address`, from local address `source` if given (another
    loopback address: the endpoint sees another peer); with `secret`, through the endpoints' CURVE
    layer (a peer that holds the secret). Sends block once zmq's queue is full, so a flood goes as
    fast as the endpoint reads it; one that blocks 5 s raises zmq.Again."""

    def __init__(self, address: str, source: str | None = None, secret: bytes | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)
        if secret is not None:
            self.sock.curve_serverkey = curve_server_key(secret)
            self.sock.curve_publickey, self.sock.curve_secretkey = zmq.curve_keypair()
        target = address if source is None else address.replace("tcp://", f"tcp://{source}:0;")
        self.sock.connect(target)

    def send(self, parts: list[bytes]) -> None:
        self.sock.send_multipart(parts)

    def recv(self, timeout: float) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000)):
            return self.sock.recv_multipart()
        return None

    def recv_all(self, timeout: float) -> list[list[bytes]]:
        out = []
        end = time.monotonic() + timeout
        while (msg := self.recv(max(0.0, end - time.monotonic()))) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


# ZMTP 3.0: the greeting of a client of the NULL mechanism, and its READY command as a DEALER
NULL_GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32
_READY_BODY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY_DEALER = bytes([0x04, len(_READY_BODY)]) + _READY_BODY


def zmtp_dealer(address: str) -> socket.socket:
    """A raw TCP connection that has done ZMTP 3.0's NULL handshake as a DEALER: what follows
    are message frames, written by hand."""
    sock = socket.create_connection(host_port(address), timeout=5)
    sock.sendall(NULL_GREETING)
    got = b""
    while len(got) < 64:
        chunk = sock.recv(64 - len(got))
        assert chunk, "the endpoint closed the connection during the ZMTP greeting"
        got += chunk
    sock.sendall(READY_DEALER)
    return sock


def endless_multipart(address: str, seconds: float, watch: Callable[[], bool],
                      frame_bytes: int = 64 * 1024) -> tuple[int, int]:
    """For `seconds`, send one multipart message that never ends (every frame has MORE set) as a
    raw ZMTP NULL client: greeting, READY, then frames, without waiting for the endpoint. A closed
    connection is opened again. `watch()` is called after every MiB sent; True stops the attack
    early. Returns (bytes of frames sent, connections opened)."""
    frame = bytes([0x03]) + struct.pack(">Q", frame_bytes) + b"m" * frame_bytes  # MORE | LONG
    batch = frame * max(1, (1 << 20) // len(frame))
    sent = opened = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        opened += 1
        try:
            with socket.create_connection(host_port(address), timeout=1) as sock:
                sock.sendall(NULL_GREETING + READY_DEALER)
                while time.monotonic() < end:
                    sock.sendall(batch)
                    sent += len(batch)
                    if watch():
                        return sent, opened
        except OSError:  # closed (or timed out) by the endpoint: try again
            time.sleep(0.01)
    return sent, opened


def claim_frame(sock: socket.socket, size: int) -> None:
    """Send the header of a (long) message frame claiming `size` bytes, and a few of them."""
    sock.sendall(bytes([0x02]) + struct.pack(">Q", size) + b"x" * 4096)


def closed_within(sock: socket.socket, timeout: float) -> bool:
    """True if the other end closed (or reset) `sock` within `timeout` s."""
    sock.settimeout(0.1)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # reset
            return True
        # the endpoint may send frames (e.g. its own handshake): keep reading
    return False


@contextmanager
def fake_acceptor(secret: bytes | None = None) -> Iterator[tuple[str, zmq.Socket]]:
    """A zmq ROUTER on loopback standing in for an acceptor: (its address, the socket); with
    `secret`, behind the CURVE layer of the endpoints that hold it."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        router.curve_server = True
        router.curve_secretkey = z85.encode(control_key(secret))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield f"tcp://127.0.0.1:{port}", router
    finally:
        router.close(0)
        ctx.term()


def idle_connections(address: tuple[str, int], n: int, sources: list[str]) -> list[socket.socket]:
    """`n` TCP connections to `address`, from the `sources` addresses in turn, that never send a
    byte. The connects do not wait (non-blocking): a full accept queue delays none of them."""
    socks = []
    for i in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.bind((sources[i % len(sources)], 0))
        s.connect_ex(address)  # EINPROGRESS: the kernel completes it
        socks.append(s)
    return socks


class Trickle:
    """Slow-loris on a tcp data listener: `n` connections from `source`, each sending one byte of
    a preamble every `interval` s (`interval` None: never a byte), on a thread of their own."""

    def __init__(self, address: tuple[str, int], n: int, interval: float | None,
                 source: str = "127.0.0.3"):
        self.socks = []
        for _ in range(n):
            s = socket.socket()
            s.bind((source, 0))
            s.connect(address)
            self.socks.append(s)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._interval is not None and not self._stop.wait(self._interval):
            for s in self.socks:
                with contextlib.suppress(OSError):  # closed by the listener: that is the point
                    s.send(b"L")

    def closed(self) -> int:
        """How many of the connections the listener has closed."""
        n = 0
        for s in self.socks:
            s.setblocking(False)
            try:
                n += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                n += 1
        return n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.socks:
            s.close()
