"""Tests of the `verbs` backend (pyverbs RC QPs) on a real RDMA device: its resources and its data
path with honest peers. They protect one registration per region (none left, nor any QP or thread,
after close), the two RC QPs per session with the Anchor's higher traffic class, completion per
(request, stream) with no byte crossing requests, the Anchor overtaking a queued Residual (strict)
and the Residual's share (weighted), release() fencing the sender's in-flight writes, and device /
GID selection. Misbehaving and dying peers are in test_verbs_faults.py.

They run inside the soft-RoCE QEMU guest (`scripts/rdma_vm.sh -- .venv/bin/python -m pytest -m
rdma_vm tests/transport`), where rxe0 exists; elsewhere they skip. The guest moves about 10 MB/s,
so transfers are small. Device / GID index come from LYNX_RDMA_DEVICE / LYNX_RDMA_GID_INDEX.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time

import numpy as np
import pytest
from session_pair import pattern, wait_until
from verbs_guest import (
    GUEST_MARKS,
    LONG_HEARTBEAT_S,
    A,
    KiB,
    R,
    device_options,
    main_thread_mrs,
    rdma_devices,
    rdma_resources,
    verbs_endpoint,
)

from lynx_transport import (
    BackendUnavailableError,
    Endpoint,
    FailureReason,
    PriorityPolicy,
    Status,
)

pytestmark = GUEST_MARKS


# ---------------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
def test_registration_once_and_released_on_close():
    """MRs: one per region at register(), with no rkey published (peers write through per-extent
    registrations), none left after close; no QP, MR or thread survives Endpoint.close()."""
    threads_before = {t.ident for t in threading.enumerate()}
    ep = verbs_endpoint("reg")
    try:
        base = len(main_thread_mrs())
        buf = np.zeros(256 * KiB, np.uint8)
        ro = np.ones(64 * KiB, np.uint8)
        ro.flags.writeable = False
        r_w = ep.register(buf)
        r_ro = ep.register(ro)
        assert len(main_thread_mrs()) == base + 2
        assert r_w.backend_handle.buf == buf.ctypes.data
        assert r_w.backend_info == {} and r_ro.backend_info == {}  # nothing to publish
        ep.deregister(r_ro)
        assert len(main_thread_mrs()) == base + 1
        stats = ep.stats()["backend"]
        assert stats["regions"] == 1 and stats["device"] in rdma_devices()
    finally:
        ep.close()
    assert main_thread_mrs() == []
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
    qps = {q["lqpn"]: q for q in rdma_resources("qp") if q["lqpn"] in ours}
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
    assert [q for q in rdma_resources("qp") if q["type"] != "GSI"] == []
    assert rdma_resources("mr") == []
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
    mrs_before = len(rdma_resources("mr"))
    for rid, (na, nr) in sizes.items():
        s_rx.announce(rid, {A: [(dst.id, off, na)], R: [(dst.id, off + na, nr)]}, deadline_s=60)
        where[rid] = off
        off += na + nr
        data[rid] = pattern(na + nr, rid)
        srcs[rid] = tx.register(data[rid])
    mrs_registered = len(rdma_resources("mr"))
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
    assert len(rdma_resources("mr")) == mrs_registered  # no per-chunk registration
    # A statistic counted as this host's completions come in, which may be after the peer's ACK.
    deadline = time.monotonic() + 30
    while tx.stats()["backend"]["bytes_sent"] != total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tx.stats()["backend"]["bytes_sent"] == total
    assert rx.stats()["backend"]["crc_errors"] == 0
    for rid in sizes:
        s_rx.release(rid)
    assert rx.stats()["backend"]["exposed_extents"] == 0
    assert len(rdma_resources("mr")) == mrs_registered - 6


@pytest.mark.timeout(180)
def test_anchor_overtakes_queued_residual():
    """Strict priority: an Anchor posted after a large Residual completes first; the Residual is
    still landing when the Anchor is complete."""
    rx = verbs_endpoint("rx")
    tx = verbs_endpoint("tx", chunk=16 * KiB, residual_outstanding=1)
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
        wait_until(lambda: s_rx.recv_state(1, R).nbytes > 0, 30,  # the Residual is on the wire
                   "the first Residual bytes", poll_s=0.002)
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
    rx = verbs_endpoint("rx")
    tx = Endpoint(backend="verbs", name="tx", peer_timeout_s=LONG_HEARTBEAT_S,
                  policy=PriorityPolicy(mode=mode, residual_share=share, chunk_bytes=8 * KiB),
                  backend_options=device_options(residual_outstanding=1))
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
    wait_until(lambda: s_rx.recv_state(1, A).nbytes > 0, 30, "the first Anchor bytes",
               poll_s=0.002)
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
