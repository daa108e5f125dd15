"""Shaped-link tests: two network namespaces, a veth pair, tc tbf at 1 Gbit/s (scripts/netlab.sh).

Bounds here are looser than the benchmark goals (scripts/bench_link.py reports the real figures):
CI machines are small and shared, and these tests must not flake.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from lynx_transport import linkbench as lb

pytestmark = pytest.mark.netns
MiB = 1 << 20

_reason = lb.netns_available()


@pytest.fixture(scope="module")
def lab():
    if _reason:
        pytest.skip(f"shaped-link tests need network namespaces: {_reason}")
    with lb.NetLab(f"lxt{os.getpid() % 100000}") as lab:
        lab.rate("1gbit")
        yield lab


@pytest.mark.timeout(180)
def test_goodput_vs_raw_socket_1gbit(lab):
    g = lb.measure_goodput(lab, 64 * MiB, 2, mooncake=False)
    assert 0.7 < g["raw_gbps"] < 1.05, g  # the shaper works
    assert g["goodput_ratio_lynx_over_raw"] >= 0.85, g


@pytest.mark.timeout(180)
def test_anchor_unaffected_by_residual_1gbit(lab):
    p = lb.measure_priority(lab, 16 * MiB, 64 * MiB, 3, delay=0.1)
    # ideal 16 MiB at 1 Gbit/s = 134 ms; the anchor must not share the link with the residual
    assert min(p["alone_s"]) < 0.25, p
    # (a fair FIFO share would take ~2x; medians of 3 interleaved runs)
    assert p["ratio_together"] <= 1.3, p
    assert p["ratio_midflight"] <= 1.3, p
    # and the residual still finished (after the anchor)
    assert all(r > a for r, a in zip(p["together_residual_s"], p["together_s"], strict=True))


@pytest.mark.timeout(180)
def test_tos_marking_honoured_by_priority_qdisc(lab):
    lab.rate("1gbit", "prio")  # pfifo_fast: 3 strict bands chosen from the sockets' TOS/priority
    try:
        p = lb.measure_priority(lab, 16 * MiB, 64 * MiB, 2, delay=0.1)
        assert p["ratio_midflight"] <= 1.2, p
    finally:
        lab.rate("1gbit")


@pytest.mark.timeout(180)
@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                    reason="mooncake-transfer-engine-non-cuda not installed")
def test_side_by_side_with_mooncake(lab):
    g = lb.measure_goodput(lab, 32 * MiB, 2, mooncake=True, raw=False)
    assert g["mooncake_check"] is True
    assert g["mooncake_gbps"] > 0.5 and g["lynx_gbps"] > 0.5, g
    assert g["ratio_lynx_over_mooncake"] >= 0.8, g
