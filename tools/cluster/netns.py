"""A shaped link on one box: two network namespaces joined by a tbf-shaped veth pair (the packaged
`netlab.sh`), plus TCP port forwarders from this process's namespace into them, so health checks
and clients keep using 127.0.0.1.

`ShapedLink` is the one wrapper of `netlab.sh`: the cluster launcher (`--link RATE`) and the link
benchmarks (`bench.link`) both use it. It creates the namespaces `<name>-a` (SENDER_IP: the prefill
or the sending side) and `<name>-b` (RECEIVER_IP: decode, router, receiving side) and removes them
in `close()`. Needs root and iproute2 (`netns_available` says why not). `Forwarder` accepts on
127.0.0.1 here and connects to a target inside a namespace: each connection's thread enters the
namespace (setns affects only the calling thread) before it opens the upstream socket; sockets
keep their namespace afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
from pathlib import Path

from lynx_sglang.errors import LynxError

logger = logging.getLogger(__name__)

NETLAB = Path(__file__).with_name("netlab.sh")
SENDER_IP = "10.79.0.1"
RECEIVER_IP = "10.79.0.2"
QDISCS = ("fifo", "prio", "htb")
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT_S = 30


class LinkError(LynxError):
    pass


def netns_available() -> str | None:
    """None if shaped links can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if not NETLAB.is_file():
        return f"{NETLAB} missing (a broken install of lynx-sglang)"
    probe = f"lxp{os.getpid() % 100000}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True,
                       timeout=_COMMAND_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', b'') or exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True,
                       timeout=_COMMAND_TIMEOUT_S)
    return None


class ShapedLink:
    """Two namespaces and a veth pair; `open()`/`close()` or use as a context manager."""

    def __init__(self, name: str | None = None):
        if os.geteuid() != 0:
            raise LinkError("a shaped link needs root (network namespaces and tc)")
        if not NETLAB.is_file():
            raise LinkError(f"a shaped link needs {NETLAB} (missing: a broken install)")
        self.name = name or "lx" + secrets.token_hex(3)
        self.sender_ns = f"{self.name}-a"
        self.receiver_ns = f"{self.name}-b"
        self.rate: str | None = None
        self.qdisc: str | None = None
        self._up = False

    def _netlab(self, *args: str) -> None:
        proc = subprocess.run(["bash", str(NETLAB), *args], capture_output=True, text=True,
                              timeout=_COMMAND_TIMEOUT_S)
        if proc.returncode != 0:
            raise LinkError(f"netlab.sh {' '.join(args)} failed: {proc.stderr.strip()}")

    def open(self) -> ShapedLink:
        self._netlab("down", self.name)  # a leftover of a killed run with the same name
        self._netlab("up", self.name)
        self._up = True
        return self

    def set_rate(self, rate: str, qdisc: str = "fifo") -> None:
        """Shape both directions to `rate` (e.g. 1gbit, 10mbit, none) under `qdisc`."""
        if qdisc not in QDISCS:
            raise LinkError(f"qdisc must be one of {QDISCS}, got {qdisc!r}")
        self._netlab("rate", self.name, rate, qdisc)
        self.rate, self.qdisc = rate, qdisc
        logger.info("shaped link %s: %s (%s), %s=%s, %s=%s", self.name, rate, qdisc,
                    self.sender_ns, SENDER_IP, self.receiver_ns, RECEIVER_IP)

    def set_up(self, up: bool) -> None:
        """Take the sender's end of the link down (a stalled link: no FIN, no RST) or up."""
        subprocess.run(["ip", "-n", self.sender_ns, "link", "set", f"{self.name}-va",
                        "up" if up else "down"], check=True, capture_output=True,
                       timeout=_COMMAND_TIMEOUT_S)

    def class_bytes(self) -> dict[str, int]:
        """Bytes sent per htb class on the sender's veth (after `set_rate(..., "htb")`)."""
        out = subprocess.run(["tc", "-n", self.sender_ns, "-s", "class", "show", "dev",
                              f"{self.name}-va"], check=True, capture_output=True, text=True,
                             timeout=_COMMAND_TIMEOUT_S)
        res, cls = {}, None
        for line in out.stdout.splitlines():
            words = line.split()
            if words[:2] == ["class", "htb"]:
                cls = words[2]
            elif words[:1] == ["Sent"] and cls:
                res[cls] = int(words[1])
                cls = None
        return res

    def close(self) -> None:
        if self._up:
            self._netlab("down", self.name)
            self._up = False

    def __enter__(self) -> ShapedLink:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

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
