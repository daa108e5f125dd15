"""`lynx_transport.link_order`: the order across the requests that share one link (issue 59).

The pure decisions (`LinkOrder.choose`, rules 1-5 of the module) on hand-fed events, the link's
rate (`LinkRate`), the bookkeeping (delivery marks, drains, a finished Residual), and one loopback
run of the tcp backend with a throttled sender: a request that has waited on its Residual
longer than a newer Anchor takes goes first with `link_order`, and after it without.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from session_pair import pattern

from lynx_transport import Endpoint, PriorityPolicy, Stream
from lynx_transport.link_order import RATE_WINDOW_S, Choice, LinkOrder, LinkRate

A, R = Stream.ANCHOR, Stream.RESIDUAL
MiB = 1 << 20


def link(bps: float | None = 1e6) -> LinkOrder:
    order = LinkOrder()
    order.rate.bps = bps
    return order


def waiting_room(order: LinkOrder, rid: int, at: float, delivered: float,
                 residual: int = 100_000, signalled: bool = False) -> None:
    """Request `rid` first queued at `at`, its Anchor ended then and delivered at `delivered`,
    its Residual (`residual` bytes) queued; `signalled`: announced with `signals_waiting`."""
    order.queued(rid, A, 1000, at, signalled=signalled)
    order.queued(rid, A, 0, at, fin=True)
    order.cut(rid, A, 1000, True)
    order.cut(rid, A, 0, True)
    order.fin_sent(rid, A, 1000 * rid)
    order.acked(1000 * rid, delivered)
    order.queued(rid, R, residual, delivered)


def test_anchor_alone_and_residual_alone():
    order = link()
    assert order.choose(0.0, None, False) == Choice(A)
    order.queued(1, A, 100, 0.0)
    assert order.choose(0.0, 1, False) == Choice(A)
    order.queued(1, R, 100, 0.0)
    assert order.choose(0.0, None, True) == Choice(R, 1)


def test_late_only_past_the_byte_bound():
    """A Residual is late from its Anchor's delivery plus its own wire time (rule 2): a newer
    Anchor goes first until then, however small."""
    order = link(1e6)  # 1 MB/s
    waiting_room(order, 1, at=0.0, delivered=1.0, residual=2_000_000)  # late from 3.0
    order.queued(2, A, 1, 1.5)
    assert order.late_since(order.rooms[1]) == pytest.approx(3.0)
    assert order.choose(2.99, 2, True) == Choice(A)
    assert order.choose(3.01, 2, True) == Choice(R, 1)


def test_a_late_residual_goes_before_newer_anchors_once_later_than_their_wire_time():
    order = link(1e6)
    waiting_room(order, 1, at=0.0, delivered=1.0)  # late from 1.1
    order.queued(2, A, 500_000, 1.5)  # newer: 0.5 s of wire
    assert order.choose(1.3, 2, True) == Choice(A)  # 0.2 s late < 0.5 s
    order.queued(3, A, 500_000, 1.6)  # a third request's Anchor adds to what 1 would wait for
    assert order.choose(1.6, 2, True) == Choice(A)  # 0.5 s late < 1 s
    order.cut(2, A, 250_000, False)
    order.cut(3, A, 500_000, True)  # 0.25 s of newer Anchors left
    assert order.choose(1.3, 2, True) == Choice(A)
    assert order.choose(1.35, 2, True) == Choice(R, 1)


def test_a_promoted_residual_stays_first_until_sent():
    """Once ahead of the newer Anchors a Residual keeps its place (no taking turns as the rate
    estimate moves, rule 4), until its request leaves with its FIN."""
    order = link(1e6)
    waiting_room(order, 1, at=0.0, delivered=1.0)
    order.queued(2, A, 100_000, 1.5)
    assert order.choose(1.21, 2, True) == Choice(R, 1)
    order.rate.bps = 1e3  # the newer Anchor would now take 100 s
    order.queued(3, A, 10**9, 1.7)
    assert order.choose(1.22, 2, True) == Choice(R, 1)
    order.queued(1, R, 0, 1.2, fin=True)
    order.cut(1, R, 100_000, True)
    order.cut(1, R, 0, True)
    order.fin_sent(1, R, 10**6)
    assert order.choose(1.3, 2, False) == Choice(A)


def test_anchor_first_within_a_request():
    """A request whose Anchor is not delivered yet is not late: its Residual stays behind
    every Anchor, however old it is (rule 1)."""
    order = link(1e9)
    order.queued(1, A, 1000, 0.0)
    order.queued(1, A, 0, 0.0, fin=True)
    order.cut(1, A, 1000, True)
    order.cut(1, A, 0, True)
    order.fin_sent(1, A, 5000)
    order.queued(1, R, MiB, 0.0)
    order.queued(2, A, 10, 1.0)
    order.acked(4999, 50.0)  # the FIN's last byte not acknowledged yet
    assert order.pending_delivery()
    assert order.choose(100.0, 2, True) == Choice(A)
    order.acked(5000, 100.0)
    assert not order.pending_delivery()
    assert order.rooms[1].anchor_done_at == 100.0
    assert order.choose(100.1, 2, True) == Choice(R, 1)


def test_older_anchors_keep_their_place():
    """An Anchor queue headed by a request no newer than the late one stays first; only the
    newer requests' Anchor bytes count against the late one."""
    order = link(1e6)
    order.queued(1, A, 100, 0.0)  # older, a streamed Anchor still coming
    waiting_room(order, 2, at=0.5, delivered=1.0)  # late from 1.1
    assert order.choose(50.0, 1, True) == Choice(A)
    order.rooms[1].queued[A].nbytes = 0  # the old one's bytes are sent; its FIN still queued
    order.queued(3, A, 100_000, 2.0)
    assert order.choose(1.15, 3, True) == Choice(A)  # 0.05 s late < 0.1 s of newer bytes
    assert order.choose(1.21, 3, True) == Choice(R, 2)


def test_group_mates_keep_strict_order():
    """Requests whose Anchors were queued before R's Anchor ended (one forward's group, sent
    layer by layer together) are not newer than R: their Anchors stay ahead of its Residual
    however late it is, and do not count against it."""
    order = link(1e6)
    order.queued(1, A, 1000, 0.0)
    order.queued(2, A, 500_000, 0.01)  # the group mate: queued while 1's Anchor is open
    order.queued(1, A, 0, 0.02, fin=True)
    order.cut(1, A, 1000, True)
    order.cut(1, A, 0, True)
    order.fin_sent(1, A, 1000)
    order.acked(1000, 1.0)
    order.queued(1, R, 100_000, 0.03)  # late from 1.1
    assert order.choose(100.0, 2, True) == Choice(A)
    order.queued(3, A, 100_000, 2.0)  # a later forward's: newer; only its 0.1 s counts
    order.rooms[2].queued[A].nbytes = 0
    assert order.choose(1.15, 2, True) == Choice(A)  # the head is the group mate's FIN
    order.rooms[2].queued[A].ops = 0
    assert order.choose(1.15, 3, True) == Choice(A)  # 0.05 s late < 0.1 s
    assert order.choose(1.21, 3, True) == Choice(R, 1)


def test_no_rate_no_promotion():
    order = link(None)
    waiting_room(order, 1, at=0.0, delivered=1.0)
    order.queued(2, A, 1, 2.0)
    assert order.late_since(order.rooms[1]) is None
    assert order.choose(1000.0, 2, True) == Choice(A)


def test_signalled_room_is_late_from_its_waiting_not_by_the_guess():
    """Rule 6: a request whose receiver signals is not late past its byte bound (its decode
    may still be speculating), and is late from its WAITING's arrival, before the byte bound
    where its decode does not speculate; rule 4 then weighs that lateness as before."""
    order = link(1e6)
    waiting_room(order, 1, at=0.0, delivered=1.0, residual=2_000_000, signalled=True)
    order.queued(2, A, 100_000, 1.5)  # newer: 0.1 s of wire
    assert order.late_since(order.rooms[1]) is None  # the guess would say 3.0
    assert order.choose(100.0, 2, True) == Choice(A)
    assert order.waiting(1, 1.2)  # before the byte bound's 3.0
    assert not order.waiting(1, 50.0)  # told once: the first word stands
    assert not order.waiting(9, 1.2)  # nothing of it here
    assert order.late_since(order.rooms[1]) == 1.2
    assert order.choose(1.29, 2, True) == Choice(A)  # 0.09 s late < 0.1 s of newer bytes
    assert order.choose(1.31, 2, True) == Choice(R, 1)


def test_waiting_decides_only_where_it_came():
    """Without a WAITING the unsignalled room keeps rule 2's guess, and a signalled one beside
    it waits for its word; the WAITING takes a Residual ahead of other Residuals too."""
    order = link(1e6)
    waiting_room(order, 1, at=0.0, delivered=1.0)  # no signal: late from 1.1 (the guess)
    waiting_room(order, 2, at=0.5, delivered=2.0, signalled=True)
    order.queued(3, A, 100_000, 3.0)
    assert order.late_since(order.rooms[1]) == pytest.approx(1.1)
    assert order.late_since(order.rooms[2]) is None
    assert order.residual_next() == 1  # delivered first
    order.waiting(2, 2.5)
    assert order.residual_next() == 2  # its decode waits: before one whose decode may not
    assert order.choose(2.61, 3, True) == Choice(R, 2)


def test_waiting_before_the_rate_is_known():
    """Until the rate is measured a WAITING takes its Residual ahead of newer Anchors only
    when none of their bytes are queued (their wire time cannot be weighed yet)."""
    order = link(None)
    waiting_room(order, 1, at=0.0, delivered=1.0, signalled=True)
    order.queued(2, A, 100, 2.0)
    order.waiting(1, 2.0)
    assert order.choose(100.0, 2, True) == Choice(A)
    order.cut(2, A, 100, False)  # its bytes sent, its FIN still queued
    assert order.choose(100.0, 2, True) == Choice(R, 1)


def test_residuals_delivered_first_then_oldest():
    order = link()
    for rid, at in ((1, 0.0), (2, 1.0)):  # Anchors not delivered: FIFO by age
        order.queued(rid, R, 100, at)
    assert order.residual_next() == 1
    waiting_room(order, 3, at=2.0, delivered=5.0)
    waiting_room(order, 4, at=3.0, delivered=4.0)  # newer, but its Anchor delivered first
    assert order.residual_next() == 4
    order.drained(4, R)  # its Residual dropped (a NACK): it has none queued
    assert order.residual_next() == 3
    order.drained(3, None)
    assert 3 not in order.rooms
    assert order.residual_next() == 1


def test_a_finished_residual_forgets_its_request():
    order = link()
    waiting_room(order, 1, at=0.0, delivered=1.0, residual=10)
    order.queued(1, R, 0, 1.0, fin=True)
    order.cut(1, R, 10, True)
    order.cut(1, R, 0, True)
    order.fin_sent(1, R, 99)
    assert order.rooms == {}
    order.cut(1, A, 5, True)  # late events of a forgotten request are ignored
    order.fin_sent(1, A, 5)
    assert order.rooms == {}


def test_anchor_bytes_count_down_as_they_are_cut():
    order = link()
    order.queued(1, A, 3000, 0.0)
    order.cut(1, A, 1000, False)
    assert order.rooms[1].queued[A].nbytes == 2000 and order.rooms[1].has(A)
    order.cut(1, A, 2000, True)
    assert order.rooms[1].queued[A].nbytes == 0 and not order.rooms[1].has(A)


def test_rate_from_backlogged_windows_only():
    rate = LinkRate()
    rate.observe(0.0, 0, True)
    rate.observe(RATE_WINDOW_S / 2, 10**9, True)  # too short a window: no sample
    assert rate.bps is None
    rate.observe(1.0, 1_000_000, True)
    assert rate.bps == pytest.approx(1e6)
    rate.observe(1.5, 1_000_000, False)  # idle: says nothing, and ends the window
    rate.observe(10.0, 1_000_000, True)
    assert rate.bps == pytest.approx(1e6)
    rate.observe(11.0, 3_000_000, True)  # 2 MB/s: the running average moves by 0.3
    assert rate.bps == pytest.approx(1.3e6)
    rate.observe(12.0, 3_000_000, True)  # a stall is not a rate
    assert rate.bps == pytest.approx(1.3e6)
    rate.observe(13.0, 3_300_000, True)  # slower: 0.7 of the way to it
    assert rate.bps == pytest.approx(0.3e6 + 0.3 * 1.0e6)


def test_link_order_is_strict_modes():
    assert PriorityPolicy(link_order=True).link_order
    with pytest.raises(ValueError, match="link_order"):
        PriorityPolicy(mode="weighted", link_order=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("link_order", [True, False])
def test_loopback_late_residual_before_newer_anchor(link_order):
    """Request 1's Anchor is delivered; its Residual (0.2 s of wire) is queued 0.6 s later (an
    encode that took long), just after request 2's Anchor (0.2 s): it is later than its byte
    bound by more than that Anchor takes, so with link_order it goes first, without it after."""
    rate = 20_000_000  # throttled sender: the link's rate, deterministic on loopback
    rx = Endpoint(name="rx")
    tx = Endpoint(name="tx", policy=PriorityPolicy(chunk_bytes=256 << 10, link_order=link_order),
                  backend_options={"_throttle_bps": rate})
    try:
        s_tx = tx.connect(rx.address, timeout=5)
        s_rx = rx.accept(timeout=5)
        n_a1, n_r1, n_a2 = 6 * MiB, 4 * MiB, 4 * MiB  # 6 MiB: the link's rate is measured
        total = n_a1 + n_r1 + n_a2
        stage = np.zeros(total, np.uint8)
        dst = rx.register(stage)
        src = tx.register(pattern(total, 7))
        s_rx.announce(1, {A: [(dst.id, 0, n_a1)], R: [(dst.id, n_a1, n_r1)]})
        s_rx.announce(2, {A: [(dst.id, n_a1 + n_r1, n_a2)]})
        s_tx.wait_announcement(2, timeout=5)
        s_tx.write_stream(1, A, src, 0, n_a1)
        s_tx.finish(1, A)
        assert s_rx.wait(1, A, timeout=10).ok
        time.sleep(0.6)
        s_tx.write_stream(2, A, src, n_a1 + n_r1, n_a2)
        s_tx.finish(2, A)
        s_tx.write_stream(1, R, src, n_a1, n_r1)
        s_tx.finish(1, R)
        r1 = s_rx.wait(1, R, timeout=30)
        a2 = s_rx.wait(2, A, timeout=30)
        assert r1.ok and a2.ok
        assert (r1.t_done < a2.t_done) is link_order, (r1.t_done, a2.t_done)
        assert np.array_equal(stage, np.asarray(src.view))
    finally:
        tx.close()
        rx.close()
