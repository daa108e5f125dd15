"""Host-side checks of the `verbs` backend that need no RDMA device: option validation, the clear
errors when pyverbs or a device is missing, the notice format, and the backend's data path on a
model NIC (fake_pyverbs.py: per-extent registration, a WRITE beyond its extent refused, the FIN
aux checksum). The real-device tests are test_verbs_datapath.py and test_verbs_faults.py, in the
soft-RoCE guest."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from lynx_transport import (
    BackendUnavailableError,
    Endpoint,
    FailureReason,
    PriorityPolicy,
    Status,
    Stream,
)
from lynx_transport.verbs import _import_pyverbs
from lynx_transport.verbs_options import VerbsOptions
from lynx_transport.verbs_wire import (
    FIN,
    Notice,
    NoticeError,
    pack_data_notice,
    pack_fin_notice,
    parse_notice,
)

A, R = Stream.ANCHOR, Stream.RESIDUAL
KiB = 1 << 10


def test_options_validated():
    assert VerbsOptions.from_dict({}) == VerbsOptions()
    opts = VerbsOptions.from_dict({"device": "mlx5_0", "gid_index": 3, "anchor_sl": 5})
    assert (opts.device, opts.gid_index, opts.anchor_sl) == ("mlx5_0", 3, 5)
    with pytest.raises(ValueError, match="unknown verbs backend option"):
        VerbsOptions.from_dict({"ib_device": "mlx5_0"})
    for bad in ({"anchor_sl": 16}, {"residual_tc": 256}, {"max_outstanding": 0},
                {"retry_cnt": 8}, {"ack_timeout": 32}, {"keepalive_s": 0},
                {"path_mtu": 1500}, {"gid_index": -1}):
        with pytest.raises(ValueError):
            VerbsOptions.from_dict(bad)


def test_unknown_option_refused_by_endpoint():
    with pytest.raises(ValueError, match="unknown verbs backend option"):
        Endpoint(backend="verbs", backend_options={"nope": 1})


def test_missing_pyverbs_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.enums", None)  # makes `import pyverbs.enums` fail
    with pytest.raises(BackendUnavailableError, match="python3-pyverbs"):
        _import_pyverbs()
    with pytest.raises(BackendUnavailableError, match="python3-pyverbs"):
        Endpoint(backend="verbs")


def _has_rdma_device() -> bool:
    try:
        from pyverbs.device import get_device_list

        return bool(get_device_list())
    except Exception:
        return False


@pytest.mark.skipif(_has_rdma_device(), reason="this machine has an RDMA device")
def test_no_device_is_a_clear_error():
    pytest.importorskip("pyverbs.device", reason="pyverbs not installed")
    with pytest.raises(BackendUnavailableError, match="no RDMA device"):
        Endpoint(backend="verbs")


# ------------------------------------------------------------------ the notice format
def test_notices_roundtrip_and_fin_aux_checksum():
    assert parse_notice(pack_data_notice(A, 7, 3, 4096, 100, 0xDEAD), A) == Notice(
        1, 7, 3, 4096, 100, True, 0xDEAD)
    assert not parse_notice(pack_data_notice(R, 7, 3, 0, 1, None), R).has_crc
    fin = pack_fin_notice(R, 9, 12345, b"first-token")
    n = parse_notice(fin, R)
    assert (n.kind, n.request_id, n.length, n.aux) == (2, 9, 12345, b"first-token")
    assert parse_notice(fin[:-1] + b"X", R).aux is None  # the aux failed its CRC
    assert parse_notice(pack_fin_notice(A, 1, 0, b""), A).aux == b""
    for bad in (fin[:10],  # short
                fin,  # on the other stream's QP (parsed as ANCHOR below)
                b"LXV1" + fin[4:],  # another version's magic
                pack_data_notice(A, 1, 1, 0, 10, 5) + b"trailing",
                pack_data_notice(A, 1, 1, 2**64 - 5, 10, 5),  # ends beyond 2**64
                pack_data_notice(A, 1, 1, 0, (1 << 30) + 1, 5),  # over MAX_CHUNK_BYTES
                fin[:6] + b"\x00" + fin[7:],  # a FIN without its aux CRC
                fin[:5] + b"\x07" + fin[6:]):  # unknown kind
        with pytest.raises(NoticeError):
            parse_notice(bad, A)


# ------------------------------------------------------------------ the backend on a model NIC
@pytest.fixture
def fake_nic(monkeypatch):
    import fake_pyverbs

    import lynx_transport.verbs as verbs

    monkeypatch.setattr(verbs, "_import_pyverbs", fake_pyverbs.namespace)
    return verbs


def _verbs_pair(**tx_options):
    rx = Endpoint(backend="verbs", name="rx", policy=PriorityPolicy(chunk_bytes=16 * KiB))
    tx = Endpoint(backend="verbs", name="tx", policy=PriorityPolicy(chunk_bytes=16 * KiB),
                  backend_options=tx_options)
    s_tx = tx.connect(rx.address, timeout=10)
    s_rx = rx.accept(timeout=10)
    return rx, tx, s_rx, s_tx


@pytest.mark.timeout(60)
def test_model_nic_transfer_registers_each_extent_and_drops_it_at_release(fake_nic):
    rx, tx, s_rx, s_tx = _verbs_pair()
    try:
        stage = np.zeros(256 * KiB, np.uint8)
        dst = rx.register(stage)
        assert dst.backend_info == {}  # the region-wide registration publishes nothing
        data = np.random.default_rng(1).integers(0, 256, 200 * KiB, dtype=np.uint8)
        src = tx.register(data)
        s_rx.announce(1, {A: [(dst.id, 0, 50 * KiB)], R: [(dst.id, 64 * KiB, 150 * KiB)]},
                      deadline_s=30)
        assert rx.stats()["backend"]["exposed_extents"] == 2
        ann = s_tx.wait_announcement(1, timeout=5)
        targets = [t for s in (A, R) for t in ann.targets[s]]
        assert [t["addr"] for t in targets] == [dst.addr, dst.addr + 64 * KiB]
        assert dst.backend_handle.rkey not in {t["rkey"] for t in targets}
        s_tx.write_stream(1, A, src, 0, 50 * KiB)
        s_tx.finish(1, A, aux=b"tok")
        s_tx.write_stream(1, R, src, 50 * KiB, 150 * KiB)
        s_tx.finish(1, R)
        a, r = s_rx.wait(1, A, timeout=10), s_rx.wait(1, R, timeout=10)
        assert a.ok and r.ok and a.aux == b"tok", (a, r)
        assert np.array_equal(stage[:50 * KiB], data[:50 * KiB])
        assert np.array_equal(stage[64 * KiB:214 * KiB], data[50 * KiB:])
        s_rx.release(1)
        assert rx.stats()["backend"]["exposed_extents"] == 0
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(60)
def test_model_nic_refuses_a_write_beyond_its_extent(fake_nic):
    rx, tx, s_rx, s_tx = _verbs_pair()
    bad = Endpoint(backend="verbs", name="bad", _unsafe_skip_bounds=True)
    try:
        s_bad = bad.connect(rx.address, timeout=10)
        s_rx2 = rx.accept(timeout=10)
        stage = np.zeros(128 * KiB, np.uint8)
        dst = rx.register(stage)
        src = bad.register(np.full(16 * KiB, 0xEE, np.uint8))
        s_rx2.announce(7, {A: [(dst.id, 0, 8 * KiB)]}, deadline_s=30)
        s_bad.wait_announcement(7, timeout=5)
        s_bad.write(7, A, src, 0, 8 * KiB, dst.id, 96 * KiB)  # past its extent, with its rkey
        s_bad.finish(7, A)
        sent = s_bad.wait_sent(7, A, timeout=10)
        assert sent.status is Status.FAILED and "REM_ACCESS" in sent.detail, sent
        end = time.monotonic() + 10
        while not s_rx2.closed and time.monotonic() < end:
            time.sleep(0.01)
        assert s_rx2.closed and not stage.any()
        assert rx.stats()["backend"]["exposed_extents"] == 0
        assert not s_rx.closed and not s_tx.closed  # the honest session goes on
        ok = tx.register(np.full(8 * KiB, 7, np.uint8))
        s_rx.announce(1, {A: [(dst.id, 0, 8 * KiB)]}, deadline_s=30)
        s_tx.wait_announcement(1, timeout=5)
        s_tx.write_stream(1, A, ok, 0, 8 * KiB)
        s_tx.finish(1, A)
        assert s_rx.wait(1, A, timeout=10).ok and (stage[:8 * KiB] == 7).all()
    finally:
        bad.close()
        tx.close()
        rx.close()


def _corrupt_anchor_fin(sid: bytes, stream: Stream, notice: bytes) -> bytes:
    """The verbs backend's test seam (option "_corrupt_notice"): every ANCHOR FIN's aux is
    changed after its CRC was computed."""
    return notice[:-1] + b"?" if stream is A and notice[4] == FIN else notice


@pytest.mark.timeout(60)
def test_model_nic_fin_aux_checksum_and_unchecksummed_chunks(fake_nic):
    rx, tx, s_rx, s_tx = _verbs_pair(_corrupt_notice=_corrupt_anchor_fin)
    try:
        stage = np.zeros(64 * KiB, np.uint8)
        dst = rx.register(stage)
        src = tx.register(np.full(64 * KiB, 3, np.uint8))
        s_rx.announce(1, {A: [(dst.id, 0, 16 * KiB)], R: [(dst.id, 16 * KiB, 16 * KiB)]},
                      deadline_s=30)
        s_tx.wait_announcement(1, timeout=5)
        s_tx.write_stream(1, A, src, 0, 16 * KiB)
        s_tx.finish(1, A, aux=b"first-token")
        s_tx.write_stream(1, R, src, 0, 16 * KiB)
        s_tx.finish(1, R, aux=b"ok")
        a = s_rx.wait(1, A, timeout=10)
        assert a.status is Status.FAILED and a.reason is FailureReason.CORRUPTION, a
        assert s_rx.wait(1, R, timeout=10).ok
        # a sender that ignores the receiver's checksum requirement: the chunk is refused
        tx.backend._sessions[s_tx.id].peer_requires_checksum = False
        s_rx.announce(2, {A: [(dst.id, 32 * KiB, 16 * KiB)]}, deadline_s=30)
        s_tx.wait_announcement(2, timeout=5)
        s_tx.write_stream(2, A, src, 0, 16 * KiB, checksum=False)
        s_tx.finish(2, A)
        st = s_rx.wait(2, A, timeout=10)
        assert st.status is Status.FAILED and "without a checksum" in st.detail, st
        assert st.nbytes == 0
    finally:
        tx.close()
        rx.close()
