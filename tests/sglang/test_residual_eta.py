"""When the decode expects a request's Residual (`backend.decode.Estimates`), which decides
whether speculating on the Anchor pays: from the rate recent Residuals came in at, once one long
enough has been seen, else from this request's Anchor rate."""

from __future__ import annotations

import pytest

from lynx_sglang.backend.decode import LEARN_RESIDUAL_RATE_MIN_BYTES, Estimates

MIB = 1 << 20


def test_the_first_request_goes_by_its_anchor_rate():
    eta, basis = Estimates(0.05).residual_eta(10 * MIB, anchor_rate=100 * MIB)
    assert eta == pytest.approx(0.1)
    assert "Anchor" in basis


def test_a_residual_coded_slower_than_its_anchor_moves_the_estimate():
    """The demo's case: the Anchor came at ~120 MB/s, the exact Residual (coded on the prefill
    while the Anchor is already out) at ~24 MB/s; the estimate must follow the Residual."""
    est = Estimates(0.05)
    est.learn_residual_rate(14 * MIB, 0.6)
    eta, basis = est.residual_eta(14 * MIB, anchor_rate=120 * MIB)
    assert eta == pytest.approx(0.6)
    assert "recent Residuals" in basis


def test_short_residuals_teach_nothing():
    est = Estimates(0.05)
    est.learn_residual_rate(LEARN_RESIDUAL_RATE_MIN_BYTES - 1, 0.2)  # a warm-up request
    est.learn_residual_rate(5 * MIB, 0.0)  # no interval measured
    assert est.residual_rate is None


def test_the_rate_is_a_moving_average():
    est = Estimates(0.05)
    est.learn_residual_rate(10 * MIB, 1.0)
    est.learn_residual_rate(20 * MIB, 1.0)
    assert 10 * MIB < est.residual_rate < 20 * MIB
