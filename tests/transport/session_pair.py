"""Helpers shared by the transport test modules (loopback tcp and the soft-RoCE verbs tests):
a connected endpoint pair that is always closed (over tcp: `tcp_pair`; the `pair` fixture of
conftest.py), reproducible distinct byte patterns, and a bounded wait for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from lynx_transport import Endpoint, Session


def connected_pair(rx: Endpoint, tx: Endpoint, timeout: float
                   ) -> Iterator[tuple[Endpoint, Endpoint, Session, Session]]:
    """Yield (receiver endpoint, sender endpoint, receiver session, sender session) for a fixture;
    both endpoints are closed afterwards, also when connecting fails."""
    try:
        s_tx = tx.connect(rx.address, timeout=timeout)
        s_rx = rx.accept(timeout=timeout)
        assert s_rx is not None
        yield rx, tx, s_rx, s_tx
    finally:
        tx.close()
        rx.close()


def tcp_pair() -> Iterator[tuple[Endpoint, Endpoint, Session, Session]]:
    """`connected_pair` of two tcp endpoints ("rx" and "tx", peers timed out after 3 s), for the
    `pair` fixture (conftest.py) of the loopback test modules."""
    yield from connected_pair(Endpoint(name="rx", peer_timeout_s=3.0),
                              Endpoint(name="tx", peer_timeout_s=3.0), timeout=5)


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               poll_s: float = 0.01) -> None:
    """Poll `condition` until it holds; fail the test, naming `what` it waited for, once
    `timeout_s` has passed (a hung peer must fail the test, not hang it until pytest's timeout)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(poll_s)
