"""When the decode expects a request's Residual (`backend.decode.policy.Estimates`): from the rate
the same prefill's recent Residuals came in at, once one long enough has been seen, unless this
request's Anchor came slower (then from the Anchor's rate, as for the first request); and the
decision it feeds, whether speculating on the Anchor pays
(`backend.decode.policy.decide_speculation`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lynx_sglang.backend.decode.policy import (
    LEARN_RESIDUAL_RATE_MIN_BYTES,
    MAX_RESIDUAL_LINKS,
    Estimates,
    Speculation,
    decide_speculation,
)
from lynx_sglang.config import LynxConfig
from lynx_transport import Status, Stream, StreamState

MIB = 1 << 20
# Two prefill ranks' bootstrap addresses (`DecodeRoom.prefill`).
NEAR, FAR = ("10.0.0.1", 8998), ("10.0.9.1", 8998)


def test_the_first_request_goes_by_its_anchor_rate():
    eta, basis = Estimates(0.05).residual_eta(NEAR, 10 * MIB, anchor_rate=100 * MIB)
    assert eta == pytest.approx(0.1)
    assert "Anchor" in basis


def test_a_residual_coded_slower_than_its_anchor_moves_the_estimate():
    """The demo's case: the Anchor came at ~120 MB/s, the exact Residual (coded on the prefill
    while the Anchor is already out) at ~24 MB/s; the estimate must follow the Residual."""
    est = Estimates(0.05)
    est.learn_residual_rate(NEAR, 14 * MIB, 0.6)
    eta, basis = est.residual_eta(NEAR, 14 * MIB, anchor_rate=120 * MIB)
    assert eta == pytest.approx(0.6)
    assert "this prefill's recent Residuals" in basis


def test_a_link_slower_than_recent_residuals_goes_by_this_anchor():
    """Residuals learned on a fast link (a warm-up at 1 Gbit/s), then the link slowed: this
    request's Anchor crawled in, and its Residual, behind it on the same link, will too."""
    est = Estimates(0.05)
    est.learn_residual_rate(NEAR, 8 * MIB, 0.05)  # 160 MiB/s
    eta, basis = est.residual_eta(NEAR, 8 * MIB, anchor_rate=0.4 * MIB)
    assert eta == pytest.approx(20.0)
    assert "Anchor" in basis
    on = LynxConfig.build(speculate=True)
    decision = _decide(on, anchor=_anchor(2.5), estimates=est)  # 1 MiB in 2.5 s
    assert decision.speculating and decision.residual_eta_s == pytest.approx(20.0)


def test_short_residuals_teach_nothing():
    est = Estimates(0.05)
    est.learn_residual_rate(NEAR, LEARN_RESIDUAL_RATE_MIN_BYTES - 1, 0.2)  # a warm-up request
    est.learn_residual_rate(NEAR, 5 * MIB, 0.0)  # no interval measured
    assert est.residual_rate(NEAR) is None


def test_the_rate_is_a_moving_average():
    est = Estimates(0.05)
    est.learn_residual_rate(NEAR, 10 * MIB, 1.0)
    est.learn_residual_rate(NEAR, 20 * MIB, 1.0)
    assert 10 * MIB < est.residual_rate(NEAR) < 20 * MIB


def test_each_prefill_has_its_own_rate():
    """One decode, two prefills: the near one's Residuals come in at 100 MiB/s, the far one's
    (a slower link, or a prefill whose exact Residual encode is slower) at 2 MiB/s. A room from
    the far prefill whose Anchor came fast must not be expected at the near one's rate: it would
    wait 4 s for a Residual the decode expected in 80 ms instead of speculating."""
    est = Estimates(0.05)
    for _ in range(3):
        est.learn_residual_rate(NEAR, 10 * MIB, 0.1)
        est.learn_residual_rate(FAR, 8 * MIB, 4.0)
    assert est.residual_rate(NEAR) == pytest.approx(100 * MIB)
    assert est.residual_rate(FAR) == pytest.approx(2 * MIB)
    on = LynxConfig.build(speculate=True)
    # 1 MiB of Anchor in 10 ms from each: 8 MiB of Residual to come.
    near = _decide(on, estimates=est, link=NEAR)
    far = _decide(on, estimates=est, link=FAR)
    assert near.residual_eta_s == pytest.approx(0.08) and "this prefill's" in near.why
    assert far.residual_eta_s == pytest.approx(4.0) and far.speculating
    unseen = _decide(on, estimates=est, link=("10.0.5.5", 8998))  # no Residual from it yet
    assert unseen.residual_eta_s == pytest.approx(0.08) and "this Anchor's rate" in unseen.why


def test_the_links_remembered_are_capped():
    est = Estimates(0.05)
    for port in range(MAX_RESIDUAL_LINKS + 10):
        est.learn_residual_rate(("10.0.0.1", port), 2 * MIB, 1.0)
    assert est.residual_rate(("10.0.0.1", 0)) is None  # forgotten: heard from longest ago
    assert est.residual_rate(("10.0.0.1", MAX_RESIDUAL_LINKS + 9)) == 2 * MIB
    est.learn_residual_rate(("10.0.0.1", 10), 2 * MIB, 1.0)  # heard again: kept the longest
    for port in range(1000, 1000 + MAX_RESIDUAL_LINKS - 1):
        est.learn_residual_rate(("10.0.0.1", port), 2 * MIB, 1.0)
    assert est.residual_rate(("10.0.0.1", 10)) is not None
    assert est.residual_rate(("10.0.0.1", 11)) is None


# ---- the decision -------------------------------------------------------------------------------

# A 4-layer room: 1 MiB of Anchor, 8 MiB of Residual expected.
PLAN = SimpleNamespace(num_layers=4, anchor_bytes=MIB, residual_bytes_expected=8 * MIB)


def _anchor(seconds: float = 0.01) -> StreamState:
    """The whole Anchor, in after `seconds` on the wire (100 MiB/s at the default)."""
    return StreamState(1, Stream.ANCHOR, Status.COMPLETE, MIB, t_first_byte=10.0,
                       t_done=10.0 + seconds)


def _residual(nbytes: int = 0, status: Status = Status.PENDING) -> StreamState:
    return StreamState(1, Stream.RESIDUAL, status, nbytes, t_first_byte=10.0 if nbytes else None)


def _decide(config: LynxConfig, anchor: StreamState | None = None,
            residual: StreamState | None = None, final_layers: int = 0,
            estimates: Estimates | None = None, link=NEAR):
    return decide_speculation(config, PLAN, anchor or _anchor(), residual or _residual(),
                              final_layers=final_layers, anchor_written=4,
                              estimates=estimates or Estimates(0.05), link=link)


def test_no_speculation_without_the_flag_or_once_the_residual_is_in():
    assert _decide(LynxConfig.build(speculate=False)).mode is Speculation.NOT_SPECULATING
    on = LynxConfig.build(speculate=True)
    for decision in (_decide(on, residual=_residual(8 * MIB, Status.COMPLETE)),
                     _decide(on, final_layers=4)):
        assert decision.mode is Speculation.NOT_SPECULATING
        assert decision.why == "the Residual is already in"


def test_under_tensor_parallelism_every_rank_decides_from_the_flags_alone():
    """A TP 2 decode's ranks see their streams land at their own times: a rank whose Residual is
    in must still speculate when another's is not, so both decide alike."""
    on = LynxConfig.build(speculate=True)
    for residual, final in ((_residual(8 * MIB, Status.COMPLETE), 4), (_residual(), 0)):
        decision = decide_speculation(on, PLAN, _anchor(), residual, final_layers=final,
                                      anchor_written=4, estimates=Estimates(0.05), link=NEAR,
                                      tp_ranks=2)
        assert decision.speculating and "TP 2" in decision.why
    off = decide_speculation(LynxConfig.build(speculate=False), PLAN, _anchor(), _residual(),
                             final_layers=0, anchor_written=4, estimates=Estimates(0.05),
                             link=NEAR, tp_ranks=2)
    assert off.mode is Speculation.NOT_SPECULATING


def test_policy_always_speculates_without_weighing():
    decision = _decide(LynxConfig.build(speculate=True, spec_policy="always"))
    assert decision.speculating and decision.residual_eta_s is None
    assert decision.trace_facts() == {"speculate": True, "why": "--lynx-spec-policy always"}


def test_auto_speculates_only_when_the_residual_is_due_after_what_speculating_costs():
    on = LynxConfig.build(speculate=True)
    late = _decide(on)  # 8 MiB at the Anchor's 100 MiB/s: 80 ms against one 50 ms verification
    assert late.speculating and late.residual_eta_s == pytest.approx(0.08)
    soon = _decide(on, residual=_residual(6 * MIB))  # 2 MiB left: 20 ms
    assert soon.mode is Speculation.NOT_SPECULATING and "sooner than" in soon.why
    assert list(soon.trace_facts()) == ["residual_eta_s", "speculation_cost_s", "speculate", "why"]
    slow = Estimates(0.05)
    slow.note_verification(1.0)  # verifications turned out slow: 0.335 s each now
    assert not _decide(on, estimates=slow).speculating
