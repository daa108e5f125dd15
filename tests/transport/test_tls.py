"""TLS on the tcp backend's data connections (`lynx_transport.tls`): bytes arrive exact both
ways, nothing of them is readable on the wire, certificates are checked both ways, a TLS endpoint
and a plain one refuse each other clearly, and a connection that never finishes its handshake
holds the data listener for a bounded time only. Real sockets on loopback; the certificates come
from `lynx-sglang tls-certs`' own code."""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from session_pair import connected_pair, pattern

from lynx_tools.cluster.tls_certs import make_certs
from lynx_transport import Endpoint, HandshakeError, SessionClosedError, Status, Stream
from lynx_transport.tls import TlsConfig, TlsConfigError

A, R = Stream.ANCHOR, Stream.RESIDUAL
MiB = 1 << 20


def _tls(files, check_hostname: bool = True) -> dict:
    return {"tls": TlsConfig(str(files.cert_file), str(files.key_file), str(files.ca_file),
                             check_hostname=check_hostname)}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """One CA with a node certificate for 127.0.0.1, a second CA with its own, and a node of the
    first CA whose certificate names another host."""
    d = tmp_path_factory.mktemp("tls")
    return {"good": make_certs(d / "ca1", ["127.0.0.1", "localhost"]),
            "other_ca": make_certs(d / "ca2", ["127.0.0.1"]),
            "wrong_host": make_certs(d / "ca1", ["10.9.9.9"], name="elsewhere")}


def _transfer(s_rx, s_tx, rx, tx, req: int, n_a: int, n_r: int, seed: int) -> np.ndarray:
    stage = np.zeros(n_a + n_r, np.uint8)
    dst = rx.register(stage)
    src_arr = pattern(n_a + n_r, seed)
    src = tx.register(src_arr)
    s_rx.announce(req, {A: [(dst.id, 0, n_a)], R: [(dst.id, n_a, n_r)]})
    s_tx.wait_announcement(req, timeout=5)
    s_tx.write_stream(req, A, src, 0, n_a)
    s_tx.finish(req, A, aux=b"first-token")
    s_tx.write_stream(req, R, src, n_a, n_r)
    s_tx.finish(req, R)
    for stream in (A, R):
        st = s_rx.wait(req, stream, timeout=20)
        assert st.status is Status.COMPLETE, (stream, st)
    assert s_rx.recv_state(req, A).aux == b"first-token"
    np.testing.assert_array_equal(stage, src_arr)
    s_rx.release(req)
    s_tx.release(req)
    rx.deregister(dst)
    tx.deregister(src)
    return stage


@pytest.mark.timeout(60)
def test_tls_round_trip_both_directions(certs):
    opts = _tls(certs["good"])
    for rx, tx, s_rx, s_tx in connected_pair(Endpoint(name="rx", backend_options=opts),
                                             Endpoint(name="tx", backend_options=opts),
                                             timeout=10):
        assert rx.backend.local_info()["tls"] is True
        # several chunks per stream (1 MiB each), odd sizes, then the other way round
        _transfer(s_rx, s_tx, rx, tx, 1, 3 * MiB + 17, 5 * MiB + 3, seed=1)
        _transfer(s_tx, s_rx, tx, rx, 2, 2 * MiB + 1, MiB - 5, seed=2)
        # four connections per session, one per stream and direction
        assert len(rx.backend._sessions[s_rx.id].socks) == 4


SOL_PACKET, PACKET_STATISTICS = 263, 6  # linux/if_packet.h: struct tpacket_stats


class _LoopbackCapture:
    """Every frame on the loopback interface (AF_PACKET: root) while the block runs; `drops`
    counts frames the kernel could not queue to us (a capture with drops proves nothing)."""

    def __enter__(self):
        self.frames: list[bytes] = []
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self._sock.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE (root)
        self._sock.bind(("lo", 0))
        self._sock.settimeout(0.1)
        self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8)  # reading resets the counters
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self.frames.append(self._sock.recv(1 << 17))
            except TimeoutError:
                continue

    def __exit__(self, *exc):
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(2)
        _, self.drops = struct.unpack("II", self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS,
                                                                  8))
        self._sock.close()
        self.wire = b"".join(self.frames)


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="capturing loopback frames (AF_PACKET) needs root")
def test_no_kv_byte_readable_on_the_wire(certs):
    """The same transfer captured on loopback: in clear without TLS the marker is on the wire, with
    TLS it is not (the capture itself is checked by the plain run)."""
    marker = b"LYNX-KV-SECRET-" + os.urandom(8).hex().encode()
    n = 256 * 1024

    def transfer(opts) -> None:
        for rx, tx, s_rx, s_tx in connected_pair(Endpoint(name="rx", backend_options=opts),
                                                 Endpoint(name="tx", backend_options=opts),
                                                 timeout=10):
            stage = np.zeros(n, np.uint8)
            dst = rx.register(stage)
            src_arr = np.frombuffer((marker * (n // len(marker) + 1))[:n], np.uint8).copy()
            src = tx.register(src_arr)
            s_rx.announce(7, {A: [(dst.id, 0, n)], R: []})
            s_tx.wait_announcement(7, timeout=5)
            s_tx.write_stream(7, A, src, 0, n)
            s_tx.finish(7, A, aux=marker)
            assert s_rx.wait(7, A, timeout=10).status is Status.COMPLETE
            np.testing.assert_array_equal(stage, src_arr)

    def captured(opts) -> bytes:
        for _ in range(3):  # a capture the kernel dropped frames of is taken again
            with _LoopbackCapture() as cap:
                transfer(opts)
            if not cap.drops:
                assert len(cap.wire) > n, "the transfer did not go through the capture"
                return cap.wire
        pytest.fail(f"every loopback capture dropped frames (last: {cap.drops})")

    assert marker in captured({}), "the capture saw nothing: the test could not tell"
    wire = captured(_tls(certs["good"]))
    assert marker not in wire and marker[:16] not in wire


@pytest.mark.timeout(60)
def test_tls_and_plain_endpoints_refuse_each_other(certs):
    opts = _tls(certs["good"])
    for rx_opts, tx_opts in (({}, opts), (opts, {})):
        with Endpoint(name="rx", backend_options=rx_opts) as rx, \
                Endpoint(name="tx", backend_options=tx_opts) as tx:
            with pytest.raises(HandshakeError, match="TLS") as err:
                tx.connect(rx.address, timeout=5)
            # the side that has TLS is named, whichever end found the difference first
            side = "dialing" if tx_opts else "accepting"
            assert f"the {side} end has it" in str(err.value), err.value


@pytest.mark.timeout(60)
def test_certificate_of_another_ca_is_refused_both_ways(certs):
    good, other = _tls(certs["good"]), _tls(certs["other_ca"])
    # the dialer refuses the acceptor's certificate
    with Endpoint(name="rx", backend_options=good) as rx, \
            Endpoint(name="tx", backend_options=other) as tx, \
            pytest.raises(HandshakeError, match="certificate was refused"):
        tx.connect(rx.address, timeout=5)
    # the acceptor refuses the dialer's certificate: the dialer trusts the acceptor's CA but
    # holds a certificate of another one
    mixed = {"tls": TlsConfig(str(certs["other_ca"].cert_file), str(certs["other_ca"].key_file),
                              str(certs["good"].ca_file))}
    with Endpoint(name="rx", backend_options=good) as rx, \
            Endpoint(name="tx", backend_options=mixed) as tx:
        t0 = time.monotonic()
        # refused during the connect (the acceptor's verdict) or as the first TLS record the
        # dialer reads (its alert): either way within the connect and saying TLS
        with pytest.raises((HandshakeError, SessionClosedError), match="TLS"):
            tx.connect(rx.address, timeout=4)
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while rx.backend.stats()["tls_handshakes_failed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rx.backend.stats()["tls_handshakes_failed"] >= 1
        assert rx.accept(timeout=0.5) is None  # no session came up


@pytest.mark.timeout(60)
def test_host_name_checked_by_the_dialer(certs):
    wrong = _tls(certs["wrong_host"])
    good = _tls(certs["good"])
    with Endpoint(name="rx", backend_options=wrong) as rx, \
            Endpoint(name="tx", backend_options=good) as tx, \
            pytest.raises(HandshakeError, match="certificate was refused"):
        tx.connect(rx.address, timeout=5)
    # the operator's opt-out: the chain is still checked, the name is not
    loose = _tls(certs["good"], check_hostname=False)
    for _rx, _tx, s_rx, s_tx in connected_pair(Endpoint(name="rx", backend_options=wrong),
                                               Endpoint(name="tx", backend_options=loose),
                                               timeout=10):
        assert s_rx.id == s_tx.id


@pytest.mark.timeout(60)
def test_stalled_and_garbage_handshakes_do_not_block_others(certs):
    opts = _tls(certs["good"])
    rx = Endpoint(name="rx", backend_options={**opts, "preamble_timeout_s": 1.0})
    with rx, Endpoint(name="tx", backend_options=opts) as tx:
        port = rx.backend.port
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        garbage = socket.create_connection(("127.0.0.1", port))
        garbage.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
        try:
            t0 = time.monotonic()
            s_tx = tx.connect(rx.address, timeout=5)  # while the silent ones hold their slots
            assert time.monotonic() - t0 < 3
            assert rx.accept(timeout=5) is not None
            s_tx.close()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                st = rx.backend.stats()
                if st["preambles_expired"] >= 3 and st["tls_handshakes_failed"] >= 1:
                    break
                time.sleep(0.05)
            assert st["preambles_expired"] >= 3, st
            assert st["tls_handshakes_failed"] >= 1, st
        finally:
            for s in [*silent, garbage]:
                s.close()


def test_config_errors_name_the_file(tmp_path, certs):
    with pytest.raises(TlsConfigError, match="no such file"):
        TlsConfig(str(tmp_path / "missing.pem"), str(certs["good"].key_file),
                  str(certs["good"].ca_file))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(TlsConfigError, match=r"bad\.pem"):
        TlsConfig(str(bad), str(certs["good"].key_file), str(certs["good"].ca_file)).contexts()
    with pytest.raises(TlsConfigError, match=r"bad\.pem"):
        Endpoint(name="x", backend_options={"tls": TlsConfig(
            str(certs["good"].cert_file), str(certs["good"].key_file), str(bad))})
    with pytest.raises(ValueError, match="TlsConfig"):
        Endpoint(name="x", backend_options={"tls": "yes"})


def test_contexts_are_built_once_per_config(tmp_path, certs):
    good = certs["good"]
    key = tmp_path / "key.pem"
    key.write_text("not a key")
    tls = TlsConfig(str(good.cert_file), str(key), str(good.ca_file))
    with pytest.raises(TlsConfigError, match=r"key\.pem"):
        tls.contexts()
    key.write_bytes(Path(good.key_file).read_bytes())
    first = tls.contexts()
    assert tls.contexts() is first
    assert all(isinstance(c, ssl.SSLContext) for c in first)
