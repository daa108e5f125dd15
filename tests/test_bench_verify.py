"""`lynx-sglang bench-verify`'s arithmetic and argument checks (the cluster runs are measured by
hand, docs/benchmarks.md: a timed result is never asserted)."""

from __future__ import annotations

import pytest

from lynx_tools.bench.verify import (
    BenchVerifyError,
    DepthResult,
    VerifyRun,
    _positions,
    format_table,
    step_ms_after,
)
from lynx_tools.cli import main


def test_a_step_is_the_median_gap_between_the_last_tokens():
    # A burst of verified tokens at 1.0 s, then steps of 0.1, 0.1, 0.3 s.
    t = [0.5, 1.0, 1.0, 1.0, 1.1, 1.2, 1.5]
    assert step_ms_after(t, 4) == pytest.approx(100.0)
    # Reaching back into the burst counts its zero gaps.
    assert step_ms_after([1.0, 1.0, 1.0, 1.0, 1.1, 1.2], 6) == pytest.approx(0.0)


def test_too_few_tokens_after_the_verification_is_an_error():
    with pytest.raises(BenchVerifyError, match="at least 4 streamed tokens"):
        step_ms_after([1.0, 1.1, 1.2], 4)


def test_summary_and_table_give_the_verification_in_decode_steps():
    r = DepthResult(32, [VerifyRun(32, 32, 300.0, 150.0), VerifyRun(32, 30, 450.0, 150.0),
                         VerifyRun(32, 32, 330.0, 165.0)])
    s = r.summary()
    assert s["verify_in_steps_median"] == 2.0
    assert s["verify_in_steps_min_max"] == [2.0, 3.0]
    assert s["accepted"] == [32, 30, 32]
    assert "| 32 | 330 | 150 | 2.00 (2.00-3.00) |" in format_table([r])


@pytest.mark.parametrize("text", ["", "0,8", "a,b"])
def test_bad_depths_are_refused(text):
    with pytest.raises(BenchVerifyError, match="--positions"):
        _positions(text)


def test_cli_lists_it(capsys):
    with pytest.raises(SystemExit):
        main(["bench-verify", "--help"])
    assert "--residual-hold-s" in capsys.readouterr().out
