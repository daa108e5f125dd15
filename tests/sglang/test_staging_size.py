"""How long a request a staging pool holds (`backend.plan.max_tokens_in_staging`), which the KV
manager states at start-up (a warning when the server takes longer requests)."""

from __future__ import annotations

import pytest

from lynx_kernels import preset
from lynx_sglang.backend.plan import max_tokens_in_staging, room_plans
from lynx_sglang.backend.staging import ALIGN
from lynx_sglang.config import LynxConfig


def _need(config, shape, n):
    plan = room_plans(config, shape, n)[config.codec.anchor_bits]
    return -(-plan.staging_bytes // ALIGN) * ALIGN


@pytest.mark.parametrize("width", ["fixed", "adaptive"])
@pytest.mark.parametrize("target", ["exact", "int8"])
@pytest.mark.parametrize("model", ["SmolLM2-135M", "Llama-3.1-8B"])
def test_the_longest_request_that_fits_is_the_boundary(target, model, width):
    config, shape = LynxConfig.build(target=target, anchor_width=width), preset(model)
    staging = 256 << 20
    n = max_tokens_in_staging(config, shape, staging, ALIGN, 1 << 20)
    assert 0 < n < 1 << 20
    assert _need(config, shape, n) <= staging < _need(config, shape, n + 1)


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_adaptive_widths_hold_the_largest_of_each_stream(target):
    """Staging for either width the prefill may pick: the 4-bit Anchor's extent and the larger
    Residual bound (int8: the 3-bit Anchor's 5 low bits; exact: the same raw bound)."""
    shape = preset("SmolLM2-135M")
    plans = room_plans(LynxConfig.build(target=target, anchor_width="adaptive"), shape, 1500)
    three, four = plans[3], plans[4]
    assert three.anchor_bytes < four.anchor_bytes
    assert three.residual_bytes >= four.residual_bytes
    for p in (three, four):
        assert p.anchor_extent == four.anchor_bytes and p.residual_extent == three.residual_bytes
        assert p.staging_bytes >= max(three.anchor_bytes + three.residual_bytes,
                                      four.anchor_bytes + four.residual_bytes)
    if target == "int8":
        assert three.staging_bytes > three.anchor_bytes + three.residual_bytes
    fixed = room_plans(LynxConfig.build(target=target), shape, 1500)[4]
    assert fixed.staging_bytes == fixed.anchor_bytes + fixed.residual_bytes


def test_capped_by_the_longest_request_and_zero_when_none_fits():
    config, shape = LynxConfig(), preset("SmolLM2-135M")
    assert max_tokens_in_staging(config, shape, 256 << 20, ALIGN, 1000) == 1000
    assert max_tokens_in_staging(config, shape, ALIGN, ALIGN, 1000) == 0
