"""A randomized storm on a tcp data listener while honest sessions open: the harness of
test_listener_storm.py (about 25 s in CI) and a command for longer runs:

    .venv/bin/python tests/transport/listener_storm.py --seconds 600 --json storm.json

Attackers, from 1-200 loopback source addresses (127.0.1.x) at once, run five behaviours in a
random mix: connect and stay silent, trickle preamble bytes one at a time, send part of a
preamble then reset (SO_LINGER 0), connect and close at once, and send a whole preamble slowly
(a byte every few tens of ms: it never completes within the preamble deadline) — each with a
random lifetime. Meanwhile an honest initiator opens a session to the victim endpoint, checks it
carries bytes and closes it, over and over, each under `HONEST_DEADLINE_S`. Real endpoints, real
sockets, one process (the victim's fds are counted before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from attacker import resources  # this folder: sys.path[0] for the command, pytest's for tests

from lynx_transport import Endpoint, Stream
from lynx_transport.tcp_wire import PREAMBLE

HONEST_DEADLINE_S = 5.0  # the honest initiator's connect and the acceptor's accept, each
BEHAVIOURS = ("silent", "trickle", "reset", "close", "slow_preamble")
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends RST
A, R = Stream.ANCHOR, Stream.RESIDUAL


@dataclass
class StormResult:
    seconds: float
    sources: int
    attacker_connections: int
    honest_tried: int
    honest_ok: int
    honest_failures: list[str]
    listener_alive: bool
    listener_restarts: int
    connection_errors: int
    preambles_evicted: int
    preambles_expired: int
    fds_base: int
    fds_after: int

    @property
    def honest_share(self) -> float:
        return self.honest_ok / self.honest_tried if self.honest_tried else 0.0


class _Attackers:
    """Threads that keep attacking `port` with random behaviours until `stop`."""

    def __init__(self, port: int, sources: list[str], threads: int, seed: int):
        self.port = port
        self.sources = sources
        self.connections = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[socket.socket, str, float]] = []  # socket, behaviour, until
        garbage = rng.randbytes(PREAMBLE.size)
        try:
            while not self._stop.is_set():
                if len(held) < 40:
                    with contextlib.suppress(OSError):
                        held.append(self._open(rng))
                now = time.monotonic()
                kept = []
                for sock, how, until in held:
                    if now >= until or not self._step(sock, how, rng, garbage):
                        self._end(sock, how)
                    else:
                        kept.append((sock, how, until))
                held = kept
                self._stop.wait(rng.uniform(0.001, 0.02))
        finally:
            for sock, how, _ in held:
                self._end(sock, how)

    def _open(self, rng: random.Random) -> tuple[socket.socket, str, float]:
        sock = socket.socket()
        sock.bind((rng.choice(self.sources), 0))
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        with self._lock:
            self.connections += 1
        how = rng.choice(BEHAVIOURS)
        if how == "reset":
            with contextlib.suppress(OSError):
                sock.send(rng.randbytes(rng.randrange(1, PREAMBLE.size)))
        return sock, how, time.monotonic() + (0.0 if how in ("close", "reset")
                                              else rng.uniform(0.05, 3.0))

    @staticmethod
    def _step(sock: socket.socket, how: str, rng: random.Random, garbage: bytes) -> bool:
        """One move of a held connection; False once the listener has closed it."""
        try:
            if how in ("trickle", "slow_preamble") and rng.random() < 0.5:
                sock.send(garbage[:1] if how == "trickle" else bytes([rng.randrange(256)]))
            return sock.recv(1) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    @staticmethod
    def _end(sock: socket.socket, how: str) -> None:
        with contextlib.suppress(OSError):
            if how == "reset":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            sock.close()


def _honest_once(rx: Endpoint, tx: Endpoint, req: int) -> str | None:
    """Open a session, move a small Anchor and Residual, close it; why it failed, or None."""
    s_tx = s_rx = None
    stage, data = np.zeros(8192, np.uint8), np.arange(8192, dtype=np.uint32).astype(np.uint8)
    dst, src = rx.register(stage), tx.register(data)
    try:
        s_tx = tx.connect(rx.address, timeout=HONEST_DEADLINE_S)
        s_rx = rx.accept(timeout=HONEST_DEADLINE_S)
        if s_rx is None:
            return "accept: no session within the deadline"
        s_rx.announce(req, {A: [(dst.id, 0, 4096)], R: [(dst.id, 4096, 4096)]},
                      deadline_s=HONEST_DEADLINE_S)
        s_tx.wait_announcement(req, timeout=HONEST_DEADLINE_S)
        for stream, at in ((A, 0), (R, 4096)):
            s_tx.write_stream(req, stream, src, at, 4096)
            s_tx.finish(req, stream)
        for stream in (A, R):
            st = s_rx.wait(req, stream, timeout=HONEST_DEADLINE_S)
            if not st.ok:
                return f"{stream.name}: {st}"
        return None if np.array_equal(stage, data) else "bytes differ"
    except Exception as exc:  # the storm's verdict counts every kind of failure
        return f"{type(exc).__name__}: {exc}"
    finally:
        for s in (s_tx, s_rx):
            if s is not None:
                with contextlib.suppress(Exception):
                    s.release(req)
                with contextlib.suppress(Exception):
                    s.close()
        rx.deregister(dst)
        tx.deregister(src)


def run_storm(seconds: float, n_sources: int = 200, threads: int = 4, seed: int = 0,
              honest_pause_s: float = 0.1) -> StormResult:
    """Storm a fresh endpoint's data listener for `seconds` (see the module docstring)."""
    sources = [f"127.0.1.{i}" for i in range(1, n_sources + 1)]
    rx = Endpoint(name="victim", peer_timeout_s=3.0)
    tx = Endpoint(name="honest", peer_timeout_s=3.0)
    listener = rx.backend._listener  # its counters; the thread is found by name
    base = resources()[1]
    attackers = _Attackers(rx.backend.port, sources, threads, seed)
    failures: list[str] = []
    tried = 0
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tried += 1
            why = _honest_once(rx, tx, tried)
            if why is not None:
                failures.append(why)
            time.sleep(honest_pause_s)
    finally:
        attackers.stop()
    fds_end = time.monotonic() + 10
    while (fds := resources()[1]) > base and time.monotonic() < fds_end:
        time.sleep(0.05)
    c = dict(listener.counters)
    alive = any(t.name == f"lynx-tcp-accept-{rx.backend.port}" for t in threading.enumerate())
    result = StormResult(seconds, n_sources, attackers.connections, tried, tried - len(failures),
                         failures[:20], alive, c.get("listener_restarts", 0),
                         c.get("connection_errors", 0), c["preambles_evicted"],
                         c["preambles_expired"], base, fds)
    tx.close()
    rx.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="how long to storm (600)")
    ap.add_argument("--sources", type=int, default=200, help="attacker addresses (1-250; 200)")
    ap.add_argument("--threads", type=int, default=4, help="attacker threads (4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    r = run_storm(args.seconds, args.sources, args.threads, args.seed)
    out = {**asdict(r), "honest_share": r.honest_share}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    ok = r.listener_alive and r.honest_share >= 0.99 and r.fds_after <= r.fds_base
    print("STORM:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
