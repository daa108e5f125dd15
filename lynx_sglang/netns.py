"""A shaped link for a local PD cluster: prefill and decode in two network namespaces joined by a
tbf-shaped veth pair (the repository's `scripts/netlab.sh`), plus TCP port forwarders from this
process's namespace into them, so health checks and clients keep using 127.0.0.1.

Owned by `lynx_sglang.cluster.Cluster` (`--link RATE`). Needs root and iproute2. `ShapedLink`
creates the namespaces `<name>-a` (10.79.0.1, prefill) and `<name>-b` (10.79.0.2, decode and the
router) and removes them in `close()`. `Forwarder` accepts on 127.0.0.1 here and connects to a
target inside a namespace: each connection's thread enters the namespace (setns affects only the
calling thread) before it opens the upstream socket; sockets keep their namespace afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import socket
import subprocess
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

NETLAB = Path(__file__).resolve().parents[1] / "scripts" / "netlab.sh"
SENDER_IP = "10.79.0.1"
RECEIVER_IP = "10.79.0.2"
QDISCS = ("fifo", "prio", "htb")
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT_S = 30


class LinkError(RuntimeError):
    pass


class ShapedLink:
    def __init__(self, rate: str, qdisc: str = "prio"):
        if os.geteuid() != 0:
            raise LinkError("--link needs root (network namespaces and tc)")
        if not NETLAB.is_file():
            raise LinkError(f"--link needs the repository's scripts/netlab.sh ({NETLAB} missing)")
        if qdisc not in QDISCS:
            raise LinkError(f"qdisc must be one of {QDISCS}, got {qdisc!r}")
        self.rate = rate
        self.qdisc = qdisc
        self.name = "lx" + secrets.token_hex(3)
        self.sender_ns = f"{self.name}-a"
        self.receiver_ns = f"{self.name}-b"
        self._up = False

    def _netlab(self, *args: str) -> None:
        proc = subprocess.run(["bash", str(NETLAB), *args], capture_output=True, text=True,
                              timeout=_COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            raise LinkError(f"netlab.sh {' '.join(args)} failed: {proc.stderr.strip()}")

    def open(self) -> None:
        self._netlab("up", self.name)
        self._up = True
        self._netlab("rate", self.name, self.rate, self.qdisc)
        logger.info("shaped link %s: %s (%s), %s=%s, %s=%s", self.name, self.rate, self.qdisc,
                    self.sender_ns, SENDER_IP, self.receiver_ns, RECEIVER_IP)

    def close(self) -> None:
        if self._up:
            self._netlab("down", self.name)
            self._up = False

    def wrap(self, ns: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]


def _enter_netns(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LinkError(f"setns({ns}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


class Forwarder:
    """127.0.0.1:<port> here -> (host, port) inside network namespace `ns`."""

    def __init__(self, ns: str, host: str, port: int):
        self.ns, self.host, self.port = ns, host, port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.local_port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"fwd-{ns}-{port}")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.5)
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            _enter_netns(self.ns)
            upstream = socket.create_connection((self.host, self.port), timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        pump = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        pump.start()
        _pump(client, upstream)
        pump.join(timeout=5)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._thread.join(timeout=5)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            src.close()
