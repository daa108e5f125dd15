"""Which rooms a prefill layer-streams (`backend.prefill.stream_policy.StreamPolicy`): a decode's first
room goes after its forward to measure the link; then a room is streamed only where its Anchor,
sent after the forward, would take at least `min_share` of the forward; a link not measured for
PROBE_EVERY_S and PROBE_EVERY_ROOMS streamed rooms while streaming is measured again; `min_share`
0 streams everything."""

from __future__ import annotations

import pytest

from lynx_sglang.backend.prefill.stream_policy import (
    MAX_LINKS,
    PROBE_EVERY_ROOMS,
    PROBE_EVERY_S,
    StreamPolicy,
)
from lynx_sglang.config import LynxConfig, LynxConfigError

MB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def policy(min_share: float = 0.1) -> tuple[StreamPolicy, Clock]:
    clock = Clock()
    return StreamPolicy(min_share, clock), clock


def test_the_first_room_to_a_decode_probes_the_link():
    p, _ = policy()
    p.observe_forward(1500, 4.0)
    d = p.decide("decode-a:1", 10 * MB, 1500)
    assert not d.stream and "probe" in d.why


def test_a_fast_link_sends_after_the_forward_and_a_slow_one_streams():
    p, _ = policy()
    p.observe_forward(1500, 4.0)  # 4 s forwards
    # 10 MiB delivered 0.07 s after the forward (5 Gbit/s-like): 0.02 of the forward.
    p.observe_anchor("fast:1", 10 * MB, 0.07)
    d = p.decide("fast:1", 10 * MB, 1500)
    assert not d.stream and "0.02 of the forward" in d.why
    # The same Anchor took 2 s on another decode's link (44 Mbit/s-like): half the forward.
    p.observe_anchor("slow:1", 10 * MB, 2.0)
    assert p.decide("slow:1", 10 * MB, 1500).stream
    # A short prompt's forward is short: the fast link's Anchor is then a larger share of it.
    p.observe_anchor("fast:1", 10 * MB, 0.07)
    assert p.decide("fast:1", 10 * MB, 100).stream


def test_the_share_threshold_is_the_flag():
    p, _ = policy(min_share=0.5)
    p.observe_forward(1000, 1.0)
    p.observe_anchor("d:1", MB, 0.4)
    assert not p.decide("d:1", MB, 1000).stream
    p.observe_anchor("d:1", MB, 0.6)  # a slower sample weighs 0.7: 0.4 -> 0.54
    assert p.decide("d:1", MB, 1000).stream


def test_a_link_that_slows_down_is_followed_at_once_one_that_speeds_up_gradually():
    """Sending after the forward on a slow link costs the whole Anchor wire time; streaming on
    a fast one only a share of the forward: a slower measurement weighs more."""
    p, _ = policy()
    p.observe_forward(1500, 4.5)
    p.observe_anchor("d:1", 10 * MB, 0.1)  # the warm-up at 1 Gbit/s
    p.observe_anchor("d:1", 10 * MB, 1.9)  # the link shaped to 51 Mbit/s: one room
    d = p.decide("d:1", 10 * MB, 1500)
    assert d.stream and "0.30 of the forward" in d.why
    p.observe_anchor("d:1", 10 * MB, 0.1)  # one fast sample (a probe) does not undo it
    assert p.decide("d:1", 10 * MB, 1500).stream


def test_no_forward_timed_yet_streams():
    p, _ = policy()
    p.observe_anchor("d:1", MB, 0.001)
    d = p.decide("d:1", MB, 1000)
    assert d.stream and "no forward" in d.why


def test_a_streaming_link_is_probed_again_after_a_while():
    """Once both PROBE_EVERY_S and PROBE_EVERY_ROOMS streamed rooms have passed: a probe costs
    its room the Anchor's wire time, so a decode with few requests is not probed every 5 min."""
    p, clock = policy()
    p.observe_forward(1000, 1.0)
    p.observe_anchor("d:1", MB, 1.0)  # slow: stream
    assert p.decide("d:1", MB, 1000).stream
    clock.t += PROBE_EVERY_S + 1
    for _ in range(PROBE_EVERY_ROOMS - 1):
        assert p.decide("d:1", MB, 1000).stream  # not enough rooms since
    probe = p.decide("d:1", MB, 1000)
    assert not probe.stream and "probe" in probe.why
    # One probe, not every room until its measurement lands; rooms alone do not make one.
    for _ in range(2 * PROBE_EVERY_ROOMS):
        assert p.decide("d:1", MB, 1000).stream
    # The link got fast: the probe's measurement turns streaming off.
    for _ in range(12):
        p.observe_anchor("d:1", MB, 0.001)
    assert not p.decide("d:1", MB, 1000).stream


def test_the_links_remembered_are_bounded():
    """Decode addresses come from the bootstrap: the table keeps the MAX_LINKS most recently
    measured, and a forgotten decode is probed again."""
    p, _ = policy()
    p.observe_forward(1000, 1.0)
    for i in range(MAX_LINKS + 10):
        p.observe_anchor(f"d:{i}", MB, 1.0)
    p.observe_anchor("d:10", MB, 1.0)  # measured again: now the most recent
    p.observe_anchor("new:1", MB, 1.0)
    assert p.link_s_per_byte("d:10") is not None
    assert p.link_s_per_byte("d:0") is None and "probe" in p.decide("d:0", MB, 1000).why
    assert p.link_s_per_byte(f"d:{MAX_LINKS + 9}") is not None


def test_zero_streams_every_room():
    p, _ = policy(min_share=0)
    assert p.decide("never-measured:1", 10 * MB, 10).stream


def test_short_forwards_are_not_timed():
    """A health check's 1-token forward costs far more per token than a prompt's: timed, it
    made every forward look long and no room was streamed on a slow link."""
    p, _ = policy()
    p.observe_forward(1500, 4.5)
    for _ in range(20):
        p.observe_forward(1, 0.1)
    p.observe_anchor("d:1", 10 * MB, 1.6)  # R ~ 1: the Anchor after the forward takes 1.6 s
    d = p.decide("d:1", 10 * MB, 1500)
    assert d.stream and "of the forward's 4.50 s" in d.why


def test_a_change_of_answer_is_flagged_once():
    """The sender logs a decode's decision when it changes (`Decision.changed`), not per room."""
    p, _ = policy()
    assert p.decide("d:1", 10 * MB, 1500).changed  # the first answer: a probe, not streamed
    assert not p.decide("d:1", 10 * MB, 1500).changed
    p.observe_forward(1500, 4.5)
    p.observe_anchor("d:1", 10 * MB, 1.6)
    d = p.decide("d:1", 10 * MB, 1500)
    assert d.stream and d.changed
    assert not p.decide("d:1", 10 * MB, 1500).changed
    assert p.decide("d:2", 10 * MB, 1500).changed  # per decode


def test_the_estimates_the_anchor_width_reads():
    """`backend.prefill.anchor_width` weighs a room's Anchor by the link's delivery time per byte and
    the forward's predicted time: None until measured."""
    p, _ = policy()
    assert p.forward_s(1500) is None and p.link_s_per_byte("d:1") is None
    p.observe_forward(1500, 4.5)
    p.observe_anchor("d:1", 10 * MB, 1.6)
    assert p.forward_s(1000) == pytest.approx(3.0)
    assert p.link_s_per_byte("d:1") == pytest.approx(1.6 / (10 * MB))


def test_nonsense_observations_are_ignored():
    p, _ = policy()
    p.observe_forward(0, 1.0)
    p.observe_forward(1000, 0.0)
    p.observe_anchor("d:1", 0, 1.0)
    p.observe_anchor("d:1", MB, -1.0)
    assert "probe" in p.decide("d:1", MB, 100).why


def test_the_flag_is_checked():
    with pytest.raises(LynxConfigError, match="layer-stream-min-share"):
        LynxConfig.build(layer_stream_min_share=-0.1)
    with pytest.raises(ValueError):
        StreamPolicy(-1)
