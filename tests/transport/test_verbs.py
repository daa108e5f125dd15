"""Tests of the `verbs` backend (pyverbs RC QPs) on a real RDMA device.

They run inside the soft-RoCE QEMU guest (`scripts/rdma_vm.sh -- .venv/bin/python -m pytest -m
rdma_vm tests/transport`), where rxe0 exists; elsewhere they skip. The guest moves about 10 MB/s,
so transfers are small. Device / GID index come from LYNX_RDMA_DEVICE / LYNX_RDMA_GID_INDEX.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from session_pair import connected_pair, pattern

from lynx_transport import (
    BackendUnavailableError,
    Endpoint,
    FailureReason,
    OutOfBoundsError,
    PriorityPolicy,
    Status,
    Stream,
    WriteOp,
)


def _rdma_devices() -> list[str]:
    try:
        from pyverbs.device import get_device_list

        devices = get_device_list()
    except Exception:  # ImportError, or PyverbsRDMAError on a kernel without RDMA support
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


pytestmark = [
    pytest.mark.rdma_vm,
    pytest.mark.skipif(not _rdma_devices(), reason="no RDMA device; run via scripts/rdma_vm.sh"),
]

A, R = Stream.ANCHOR, Stream.RESIDUAL
KiB = 1 << 10
PEER = Path(__file__).with_name("verbs_peer.py")
# The surviving side's control-plane heartbeat timeout is long, so a peer death must be noticed
# by the verbs data path (failed work request / keepalive probe), not by the heartbeat.
LONG_HEARTBEAT_S = 60.0


def _options(**extra) -> dict:
    opts: dict = {"device": os.environ.get("LYNX_RDMA_DEVICE") or None}
    if os.environ.get("LYNX_RDMA_GID_INDEX"):
        opts["gid_index"] = int(os.environ["LYNX_RDMA_GID_INDEX"])
    opts.update(extra)
    return opts


def _endpoint(name: str, chunk: int = 64 * KiB, mode: str = "strict", **opts) -> Endpoint:
    return Endpoint(backend="verbs", name=name, peer_timeout_s=LONG_HEARTBEAT_S,
                    policy=PriorityPolicy(mode=mode, chunk_bytes=chunk),
                    backend_options=_options(**opts))


@pytest.fixture
def pair():
    """(receiver endpoint, sender endpoint, receiver session, sender session)."""
    yield from connected_pair(_endpoint("rx"), _endpoint("tx"), timeout=30)


def _rdma_resources(kind: str) -> list[dict]:
    """The kernel's `rdma resource show KIND` entries (qp, mr, …) for the whole device."""
    out = subprocess.run(["rdma", "-j", "resource", "show", kind], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return json.loads(out or "[]")


def _main_thread_mrs() -> list[dict]:
    """MRs registered by this process's main thread (the kernel records the creating task)."""
    return [r for r in _rdma_resources("mr") if r.get("pid") == os.getpid()]


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE,
                            text=True)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of `proc`, or fail after `timeout` s."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert box and box[0], f"peer printed nothing within {timeout} s (rc={proc.poll()})"
    return box[0].strip()


# ---------------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
def test_registration_once_and_released_on_close():
    """MRs: one per region at register(), with no rkey published (peers write through per-extent
    registrations), none left after close; no QP, MR or thread survives Endpoint.close()."""
    threads_before = {t.ident for t in threading.enumerate()}
    ep = _endpoint("reg")
    try:
        base = len(_main_thread_mrs())
        buf = np.zeros(256 * KiB, np.uint8)
        ro = np.ones(64 * KiB, np.uint8)
        ro.flags.writeable = False
        r_w = ep.register(buf)
        r_ro = ep.register(ro)
        assert len(_main_thread_mrs()) == base + 2
        assert r_w.backend_handle.buf == buf.ctypes.data
        assert r_w.backend_info == {} and r_ro.backend_info == {}  # nothing to publish
        ep.deregister(r_ro)
        assert len(_main_thread_mrs()) == base + 1
        stats = ep.stats()["backend"]
        assert stats["regions"] == 1 and stats["device"] in _rdma_devices()
    finally:
        ep.close()
    assert _main_thread_mrs() == []
    end = time.monotonic() + 5
    while True:
        extra = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
        if not extra or time.monotonic() > end:
            break
        time.sleep(0.05)
    assert not extra, extra


@pytest.mark.timeout(120)
def test_two_rc_qps_per_session_with_service_levels(pair):
    """Each session end has an ANCHOR and a RESIDUAL RC QP, connected pairwise to the peer's
    (the kernel's view), with the Anchor's higher traffic class; closing frees them."""
    rx, tx, s_rx, s_tx = pair
    for s, peer in ((s_rx, s_tx), (s_tx, s_rx)):
        assert len(set(s.local_prepare["qpn"])) == 2
        assert s.remote_prepare["qpn"] == peer.local_prepare["qpn"]
    ours = set(s_rx.local_prepare["qpn"]) | set(s_tx.local_prepare["qpn"])
    qps = {q["lqpn"]: q for q in _rdma_resources("qp") if q["lqpn"] in ours}
    assert len(qps) == 4, qps
    for s, peer in ((s_rx, s_tx), (s_tx, s_rx)):
        for mine, theirs in zip(s.local_prepare["qpn"], peer.local_prepare["qpn"], strict=True):
            assert qps[mine]["type"] == "RC" and qps[mine]["state"] == "RTS", qps[mine]
            assert qps[mine]["rqpn"] == theirs, qps[mine]
    import pyverbs.enums as e

    lanes = tx.backend._sessions[s_tx.id].lanes
    attrs = [lane.qp.query(e.IBV_QP_AV)[0] for lane in lanes]
    # rxe keeps the GRH traffic class (it becomes the packets' DSCP/ECN byte) but not the SL
    # (meaningless on RoCE), so only the traffic class can be read back here.
    assert attrs[0].ah_attr.traffic_class == 0xB8 and attrs[1].ah_attr.traffic_class == 0x20
    tx.close()
    rx.close()
    # nothing else uses the guest's device: every QP (but the kernel's GSI QP) and MR is gone
    assert [q for q in _rdma_resources("qp") if q["type"] != "GSI"] == []
    assert _rdma_resources("mr") == []
    assert not [t for t in threading.enumerate() if t.name.startswith("lynx-verbs")]


@pytest.mark.timeout(180)
def test_completion_per_request_and_stream(pair):
    """Several requests with distinct bytes; each (request, stream) completes on its own, with
    byte counts, aux and timestamps; no byte crosses requests."""
    rx, tx, s_rx, s_tx = pair
    sizes = {1: (48 * KiB, 200 * KiB + 5), 2: (4 * KiB + 1, 70 * KiB), 3: (130 * KiB, 1)}
    total = sum(a + r for a, r in sizes.values())
    stage = np.zeros(total, np.uint8)
    dst = rx.register(stage)
    srcs, data, where, off = {}, {}, {}, 0
    mrs_before = len(_rdma_resources("mr"))
    for rid, (na, nr) in sizes.items():
        s_rx.announce(rid, {A: [(dst.id, off, na)], R: [(dst.id, off + na, nr)]}, deadline_s=60)
        where[rid] = off
        off += na + nr
        data[rid] = pattern(na + nr, rid)
        srcs[rid] = tx.register(data[rid])
    mrs_registered = len(_rdma_resources("mr"))
    # one registration per announced extent (6) and per source region (3)
    assert mrs_registered == mrs_before + 6 + 3
    assert rx.stats()["backend"]["exposed_extents"] == 6
    for rid, (na, _nr) in sizes.items():
        s_tx.wait_announcement(rid, timeout=30)
        s_tx.write_stream(rid, A, srcs[rid], 0, na)
        s_tx.finish(rid, A, aux=f"tok-{rid}".encode())
    for rid, (na, _) in sizes.items():
        st = s_rx.wait(rid, A, timeout=60)
        assert st.ok, st
        assert st.nbytes == st.expected == na and st.aux == f"tok-{rid}".encode()
        assert st.t_start <= st.t_first_byte <= st.t_done
        # the Residual was not even posted yet: it is still pending, independently
        assert s_rx.recv_state(rid, R).status is Status.PENDING
        got = stage[where[rid]: where[rid] + na]
        assert np.array_equal(got, data[rid][:na])
    for rid, (na, nr) in sizes.items():
        s_tx.write_stream(rid, R, srcs[rid], na, nr)
        s_tx.finish(rid, R)
    for rid, (na, nr) in sizes.items():
        st = s_rx.wait(rid, R, timeout=60)
        assert st.ok and st.nbytes == nr, st
        o = where[rid]
        assert np.array_equal(stage[o: o + na + nr], data[rid])
        for stream in (A, R):
            sent = s_tx.wait_sent(rid, stream, timeout=30)
            assert sent.ok and sent.nbytes == sizes[rid][int(stream)], sent
    assert len(_rdma_resources("mr")) == mrs_registered  # no per-chunk registration
    # A statistic counted as this host's completions come in, which may be after the peer's ACK.
    deadline = time.monotonic() + 30
    while tx.stats()["backend"]["bytes_sent"] != total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.stats()["backend"]["bytes_sent"] == total
    assert rx.stats()["backend"]["crc_errors"] == 0
    for rid in sizes:
        s_rx.release(rid)
    assert rx.stats()["backend"]["exposed_extents"] == 0
    assert len(_rdma_resources("mr")) == mrs_registered - 6


@pytest.mark.timeout(180)
def test_anchor_overtakes_queued_residual():
    """Strict priority: an Anchor posted after a large Residual completes first; the Residual is
    still landing when the Anchor is complete."""
    rx = _endpoint("rx")
    tx = _endpoint("tx", chunk=16 * KiB, residual_outstanding=1)
    try:
        s_tx = tx.connect(rx.address, timeout=30)
        s_rx = rx.accept(timeout=30)
        n_r, n_a = 2048 * KiB, 64 * KiB
        stage = np.zeros(n_r + n_a, np.uint8)
        dst = rx.register(stage)
        data = pattern(n_r + n_a, 9)
        src = tx.register(data)
        s_rx.announce(1, {R: [(dst.id, 0, n_r)]}, deadline_s=120)
        s_rx.announce(2, {A: [(dst.id, n_r, n_a)]}, deadline_s=120)
        s_tx.wait_announcement(2, timeout=30)
        s_tx.write_stream(1, R, src, 0, n_r)
        s_tx.finish(1, R)
        while s_rx.recv_state(1, R).nbytes == 0:  # the Residual is on the wire
            time.sleep(0.002)
        r_before = s_rx.recv_state(1, R).nbytes
        s_tx.write_stream(2, A, src, n_r, n_a)
        s_tx.finish(2, A)
        a = s_rx.wait(2, A, timeout=60)
        r_at_anchor = s_rx.recv_state(1, R)
        assert a.ok, a
        assert r_at_anchor.status is Status.PENDING and r_at_anchor.nbytes < n_r, r_at_anchor
        r = s_rx.wait(1, R, timeout=120)
        assert r.ok and a.t_done < r.t_done
        assert np.array_equal(stage, data)
        peaks = tx.stats()["backend"]
        # bounded outstanding work: 1 Residual chunk (as configured), ≤ 16 Anchor chunks/FINs
        assert peaks["peak_inflight_residual"] == 1
        assert 1 <= peaks["peak_inflight_anchor"] <= 16
        # includes the receiver's notice-processing delay (both endpoints share one guest process)
        print(f"Residual bytes landed between posting the Anchor and the receiver seeing it "
              f"complete: {r_at_anchor.nbytes - r_before} B (chunk {16 * KiB} B); Residual at "
              f"Anchor done {r_at_anchor.nbytes}/{n_r} B")
    finally:
        tx.close()
        rx.close()


def _residual_landed_at_anchor_done(mode: str, share: float) -> tuple[int, int]:
    """Post a 1 MiB Anchor and a 1 MiB Residual together; (Residual bytes landed when the Anchor
    completed, Residual total)."""
    rx = _endpoint("rx")
    tx = Endpoint(backend="verbs", name="tx", peer_timeout_s=LONG_HEARTBEAT_S,
                  policy=PriorityPolicy(mode=mode, residual_share=share, chunk_bytes=8 * KiB),
                  backend_options=_options(residual_outstanding=1))
    try:
        s_tx = tx.connect(rx.address, timeout=30)
        s_rx = rx.accept(timeout=30)
        n_a = n_r = 1024 * KiB
        stage = np.zeros(n_a + n_r, np.uint8)
        dst = rx.register(stage)
        data = pattern(n_a + n_r, 11)
        src = tx.register(data)
        s_rx.announce(1, {A: [(dst.id, 0, n_a)], R: [(dst.id, n_a, n_r)]}, deadline_s=120)
        s_tx.wait_announcement(1, timeout=30)
        s_tx.write_stream(1, A, src, 0, n_a)
        s_tx.write_stream(1, R, src, n_a, n_r)
        s_tx.finish(1, A)
        s_tx.finish(1, R)
        a = s_rx.wait(1, A, timeout=60)
        r_at_anchor = s_rx.recv_state(1, R)
        assert a.ok, a
        assert s_rx.wait(1, R, timeout=60).ok
        assert np.array_equal(stage, data)
        return r_at_anchor.nbytes, n_r
    finally:
        tx.close()
        rx.close()


@pytest.mark.timeout(240)
def test_weighted_policy_residual_progresses_under_anchor_backlog():
    """Weighted mode: with both streams backlogged the Residual keeps its share of the bytes (no
    starvation); strict mode holds it back until the Anchor queue is empty."""
    strict, n_r = _residual_landed_at_anchor_done("strict", 0.3)
    weighted, _ = _residual_landed_at_anchor_done("weighted", 0.3)
    print(f"Residual landed when the Anchor completed: strict {strict} B, weighted(0.3) "
          f"{weighted} B of {n_r} B")
    # The configured share is 0.3 of the bytes while both are backlogged: ~439 KiB of Residual
    # by the time the 1 MiB Anchor is done; ask for 60% of it. How much Residual strict mode
    # lets through depends on timing (it fills the wire whenever the Anchor queue is momentarily
    # empty: 264 KiB once in a loaded guest), so it is only required to be less.
    assert weighted >= 256 * KiB and weighted > strict, (strict, weighted)


@pytest.mark.timeout(120)
def test_bounds_refused(pair):
    """Sender side: an out-of-bounds write raises before any work request is posted. Receiver
    side: a write outside the bounds (sender check skipped) fails the stream on both sides and
    its bytes are never counted as landed."""
    rx, tx, s_rx, s_tx = pair
    stage = np.zeros(128 * KiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(pattern(128 * KiB, 3))
    s_rx.announce(1, {A: [(dst.id, 0, 32 * KiB)]}, deadline_s=60)
    s_tx.wait_announcement(1, timeout=30)
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, A, src, 0, 32 * KiB + 1, dst.id, 0)
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, A, src, 0, 4 * KiB, dst.id, 64 * KiB)
    with pytest.raises(OutOfBoundsError):
        s_tx.write(1, R, src, 0, 4 * KiB, dst.id, 0)  # stream not announced
    time.sleep(0.2)
    assert tx.stats()["backend"]["chunks_sent"] == 0
    assert not stage.any()
    st = s_rx.recv_state(1, A)
    assert st.status is Status.PENDING and st.nbytes == 0

    # a peer that skips the sender-side check and writes inside an extent announced to it, but
    # names another request in its notice: the bytes land (one-sided), the receiver refuses them
    bad = Endpoint(backend="verbs", name="bad", peer_timeout_s=LONG_HEARTBEAT_S,
                   backend_options=_options(), _unsafe_skip_bounds=True)
    try:
        s_bad = bad.connect(rx.address, timeout=30)
        s_rx2 = rx.accept(timeout=30)
        src2 = bad.register(pattern(16 * KiB, 4))
        s_rx2.announce(8, {A: [(dst.id, 0, 8 * KiB)]}, deadline_s=60)
        ann = s_bad.wait_announcement(8, timeout=30)
        ext, info = ann.find(A, dst.id, 0, 4 * KiB)
        bad.backend.post_write(WriteOp(s_bad.id, 99, A, src2, 0, 4 * KiB, dst.id, 0, ext, info))
        end = time.monotonic() + 30
        while rx.stats()["backend"]["refused"] < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert rx.stats()["backend"]["refused"] == 1
        assert rx.stats().get("refused_unknown_request") == 1
        st8 = s_rx2.recv_state(8, A)
        assert st8.status is Status.PENDING and st8.nbytes == 0  # other requests unaffected
    finally:
        bad.close()


@pytest.mark.timeout(120)
def test_write_beyond_its_extent_is_refused_by_the_nic(pair):
    """A peer that skips the sender-side check and aims past its extent (with that extent's
    rkey: the only kind it was given) is refused by the NIC: not a byte lands outside the extent,
    its session fails on both sides, the honest session goes on. The announcement never carries
    the region-wide rkey."""
    rx, tx, s_rx, s_tx = pair
    stage = np.zeros(128 * KiB, np.uint8)
    dst = rx.register(stage)
    bad = Endpoint(backend="verbs", name="bad", peer_timeout_s=LONG_HEARTBEAT_S,
                   backend_options=_options(), _unsafe_skip_bounds=True)
    try:
        s_bad = bad.connect(rx.address, timeout=30)
        s_rx2 = rx.accept(timeout=30)
        src = bad.register(np.full(16 * KiB, 0xEE, np.uint8))
        s_rx2.announce(7, {A: [(dst.id, 0, 8 * KiB)]}, deadline_s=60)
        ann = s_bad.wait_announcement(7, timeout=30)
        (target,) = ann.targets[A]
        assert target["rkey"] != dst.backend_handle.rkey and target["addr"] == dst.addr
        s_bad.write(7, A, src, 0, 8 * KiB, dst.id, 96 * KiB)
        s_bad.finish(7, A)
        sent = s_bad.wait_sent(7, A, timeout=30)
        assert sent.status is Status.FAILED, sent
        end = time.monotonic() + 30
        while not s_rx2.closed and time.monotonic() < end:
            time.sleep(0.01)
        assert s_rx2.closed and s_bad.closed
        assert not stage.any(), "bytes landed outside the announced extent"
        print(f"write beyond its extent: sender {sent.reason.value}: {sent.detail}; "
              f"receiver: {s_rx2.close_reason.value}: {s_rx2.close_detail}")
    finally:
        bad.close()
    assert rx.stats()["backend"]["exposed_extents"] == 0  # the closed session's are gone
    src_ok = tx.register(pattern(32 * KiB, 5))
    s_rx.announce(1, {A: [(dst.id, 0, 32 * KiB)]}, deadline_s=60)
    s_tx.wait_announcement(1, timeout=30)
    s_tx.write_stream(1, A, src_ok, 0, 32 * KiB)
    s_tx.finish(1, A)
    assert s_rx.wait(1, A, timeout=30).ok
    assert np.array_equal(stage[:32 * KiB], np.asarray(src_ok.view))


@pytest.mark.timeout(120)
def test_fin_aux_checksum():
    """A FIN whose aux bytes do not match their CRC fails the stream CORRUPTION on both sides; the
    request's other stream and the session go on."""
    from lynx_transport.verbs_wire import FIN

    def corrupt_anchor_fin(sid, stream, notice):  # the backend's test seam, "_corrupt_notice"
        return notice[:-1] + bytes([notice[-1] ^ 0xFF]) if stream is A and notice[4] == FIN else notice

    sender = _endpoint("tx", _corrupt_notice=corrupt_anchor_fin)
    for endpoints_and_sessions in connected_pair(_endpoint("rx"), sender, timeout=30):
        _fin_aux_checksum(*endpoints_and_sessions)


def _fin_aux_checksum(rx, tx, s_rx, s_tx):
    stage = np.zeros(64 * KiB, np.uint8)
    dst = rx.register(stage)
    src = tx.register(pattern(64 * KiB, 6))
    s_rx.announce(1, {A: [(dst.id, 0, 32 * KiB)], R: [(dst.id, 32 * KiB, 32 * KiB)]},
                  deadline_s=60)
    s_tx.wait_announcement(1, timeout=30)
    s_tx.write_stream(1, A, src, 0, 32 * KiB)
    s_tx.finish(1, A, aux=b"first-token")
    s_tx.write_stream(1, R, src, 32 * KiB, 32 * KiB)
    s_tx.finish(1, R, aux=b"fine")
    a = s_rx.wait(1, A, timeout=30)
    assert a.status is Status.FAILED and a.reason is FailureReason.CORRUPTION, a
    assert "checksum" in a.detail
    r = s_rx.wait(1, R, timeout=30)
    assert r.ok and r.aux == b"fine", r
    sent = s_tx.wait_sent(1, A, timeout=30)
    assert sent.status is Status.FAILED and sent.reason is FailureReason.CORRUPTION
    assert not s_rx.closed


@pytest.mark.timeout(180)
def test_release_waits_for_in_flight_chunks(pair):
    """The receiver releases a request while the sender's RDMA WRITEs are in flight: when
    release() returns no further byte lands in the released extent (it waited for the sender's
    drain), and the session stays usable."""
    rx, tx, s_rx, s_tx = pair
    n = 4096 * KiB
    stage = np.zeros(n, np.uint8)
    dst = rx.register(stage)
    src = tx.register(np.full(n, 0xAB, np.uint8))
    s_rx.announce(1, {A: [(dst.id, 0, n)]}, deadline_s=120)
    s_tx.wait_announcement(1, timeout=30)
    s_tx.write_stream(1, A, src, 0, n)
    s_tx.finish(1, A)
    while s_rx.recv_state(1, A).nbytes == 0:
        time.sleep(0.002)
    s_rx.release(1, timeout=10)
    snapshot = stage.copy()
    assert not s_rx.closed and not s_tx.closed  # fenced by the sender's reply, not by closing
    assert rx.stats()["backend"]["exposed_extents"] == 0  # and the extent's registration is gone
    time.sleep(0.5)
    assert np.array_equal(stage, snapshot), "bytes landed after release() returned"
    landed = int(np.count_nonzero(snapshot))
    assert 0 < landed < n, landed
    sent = s_tx.wait_sent(1, A, timeout=30)
    assert sent.status is Status.FAILED and sent.reason is FailureReason.RELEASED, sent
    # the same session carries the next request
    s_rx.announce(2, {A: [(dst.id, 0, 64 * KiB)]}, deadline_s=60)
    s_tx.wait_announcement(2, timeout=30)
    s_tx.write_stream(2, A, src, 0, 64 * KiB)
    s_tx.finish(2, A)
    assert s_rx.wait(2, A, timeout=30).ok
    print(f"release mid-transfer: {landed}/{n} B had landed; nothing after release returned")


@pytest.mark.timeout(120)
def test_device_and_gid_selection():
    """Unknown device names are refused with the list of devices; without gid_index the GID
    whose IPv4-mapped address is the endpoint's host is chosen (RoCE v2)."""
    with pytest.raises(BackendUnavailableError, match="not found; present"):
        Endpoint(backend="verbs", backend_options={"device": "no_such_dev0"})
    ip = os.environ.get("LYNX_RDMA_IPV4")
    if not ip:
        pytest.skip("LYNX_RDMA_IPV4 (the RoCE interface address) not set; rdma_vm.sh sets it")
    ep = Endpoint(backend="verbs", host=ip, secret=b"test secret, 16+ bytes",
                  backend_options={"device": os.environ.get("LYNX_RDMA_DEVICE") or None})
    try:
        info = ep.backend.local_info()
        assert ipaddress.IPv6Address(info["gid"]).ipv4_mapped == ipaddress.IPv4Address(ip), info
        expected = os.environ.get("LYNX_RDMA_GID_INDEX")
        if expected:
            assert info["gid_index"] == int(expected)
    finally:
        ep.close()


@pytest.mark.timeout(240)
def test_sender_killed_mid_residual_fails_request():
    """The sender process dies while its Residual is landing: the receiver's Residual fails
    PEER_DIED (noticed by the verbs keepalive probe: the control-plane heartbeat timeout is set
    far longer), the Anchor that landed stays COMPLETE."""
    rx = _endpoint("rx")
    proc = None
    try:
        n_a, n_r = 64 * KiB, 4096 * KiB  # ~0.4 s at the guest's ~10 MB/s: killed while moving
        proc = _spawn("sender", rx.address, str(n_a), str(n_r))
        s_rx = rx.accept(timeout=90)
        assert s_rx is not None
        stage = np.zeros(n_a + n_r, np.uint8)
        dst = rx.register(stage)
        s_rx.announce(1, {A: [(dst.id, 0, n_a)], R: [(dst.id, n_a, n_r)]}, deadline_s=120)
        a = s_rx.wait(1, A, timeout=90)
        assert a.ok and a.aux == b"first-token", a
        while s_rx.recv_state(1, R).nbytes == 0:
            time.sleep(0.002)
        proc.kill()
        t_kill = time.monotonic()
        r = s_rx.wait(1, R, timeout=30)
        assert r.status is Status.FAILED and r.reason is FailureReason.PEER_DIED, r
        assert r.t_done - t_kill < 15.0, r.t_done - t_kill
        assert 0 < r.nbytes < n_r
        assert s_rx.recv_state(1, A).ok  # what landed stays landed
        print(f"sender killed: receiver failed the Residual after {r.t_done - t_kill:.2f}s "
              f"({r.nbytes}/{n_r} B landed): {r.detail}")
        s_rx.release(1)
        rx.deregister(dst)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(30)
        rx.close()


@pytest.mark.timeout(240)
def test_receiver_killed_mid_anchor_fails_request():
    """The receiver process dies while the Anchor is in flight: the sender's Anchor (and the
    Residual queued behind it) fail PEER_DIED from the failed RDMA work requests."""
    n_a, n_r = 4096 * KiB, 64 * KiB
    proc = _spawn("receiver", str(n_a), str(n_r))
    tx = _endpoint("tx")
    try:
        address = _readline(proc, 90)
        s_tx = tx.connect(address, timeout=60)
        src = tx.register(pattern(n_a + n_r, 5))
        s_tx.wait_announcement(1, timeout=60)
        s_tx.write_stream(1, A, src, 0, n_a)
        s_tx.finish(1, A)
        s_tx.write_stream(1, R, src, n_a, n_r)
        s_tx.finish(1, R)
        while s_tx.send_state(1, A).nbytes == 0:
            time.sleep(0.002)
        proc.kill()
        t_kill = time.monotonic()
        st = s_tx.wait_sent(1, A, timeout=30)
        assert st.status is Status.FAILED and st.reason is FailureReason.PEER_DIED, st
        assert st.t_done - t_kill < 15.0, st.t_done - t_kill
        assert st.nbytes < n_a
        r = s_tx.wait_sent(1, R, timeout=30)
        assert r.status is Status.FAILED and r.reason is FailureReason.PEER_DIED, r
        print(f"receiver killed: sender failed the Anchor after {st.t_done - t_kill:.2f}s "
              f"({st.nbytes}/{n_a} B sent): {st.detail}")
        s_tx.release(1, timeout=5)
        tx.deregister(src)
    finally:
        proc.kill()
        proc.wait(30)
        tx.close()


@pytest.mark.timeout(240)
def test_receiver_stalled_fails_by_heartbeat():
    """A stopped (SIGSTOP) receiver still ACKs RDMA at the NIC/kernel level but stops taking
    notices and control messages: the sender stalls (receiver-not-ready) and the request fails
    PEER_DIED once the control-plane heartbeat times out; tearing down the stalled QPs is clean."""
    n_a, n_r = 4096 * KiB, 64 * KiB
    proc = _spawn("receiver", str(n_a), str(n_r))
    tx = Endpoint(backend="verbs", name="tx", peer_timeout_s=3.0,
                  policy=PriorityPolicy(chunk_bytes=16 * KiB), backend_options=_options())
    try:
        address = _readline(proc, 90)
        s_tx = tx.connect(address, timeout=60)
        src = tx.register(pattern(n_a + n_r, 6))
        s_tx.wait_announcement(1, timeout=60)
        s_tx.write_stream(1, A, src, 0, n_a)
        s_tx.finish(1, A)
        while s_tx.send_state(1, A).nbytes == 0:
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        st = s_tx.wait_sent(1, A, timeout=60)
        assert st.status is Status.FAILED and st.reason is FailureReason.PEER_DIED, st
        assert st.t_done - t_stop < 30.0, st.t_done - t_stop
        assert st.nbytes < n_a
        print(f"receiver stopped: sender failed the Anchor after {st.t_done - t_stop:.2f}s "
              f"({st.nbytes}/{n_a} B sent): {st.detail}")
        s_tx.release(1, timeout=5)
        tx.deregister(src)
    finally:
        proc.kill()
        proc.wait(30)
        tx.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("lynx-verbs")]
