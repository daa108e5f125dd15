"""How long a request a staging pool holds (`backend.plan.max_tokens_in_staging`), which the KV
manager states at start-up (a warning when the server takes longer requests)."""

from __future__ import annotations

import pytest

from lynx_kernels import CodecSpec, preset
from lynx_sglang.backend.plan import StreamPlan, max_tokens_in_staging
from lynx_sglang.backend.staging import ALIGN


def _need(spec, shape, n):
    return -(-StreamPlan.build(spec, shape, n, 256).staging_bytes // ALIGN) * ALIGN


@pytest.mark.parametrize("target", ["exact", "int8"])
@pytest.mark.parametrize("model", ["SmolLM2-135M", "Llama-3.1-8B"])
def test_the_longest_request_that_fits_is_the_boundary(target, model):
    spec, shape = CodecSpec(target=target), preset(model)
    staging = 256 << 20
    n = max_tokens_in_staging(spec, shape, 256, staging, ALIGN, 1 << 20)
    assert 0 < n < 1 << 20
    assert _need(spec, shape, n) <= staging < _need(spec, shape, n + 1)


def test_capped_by_the_longest_request_and_zero_when_none_fits():
    spec, shape = CodecSpec(), preset("SmolLM2-135M")
    assert max_tokens_in_staging(spec, shape, 256, 256 << 20, ALIGN, 1000) == 1000
    assert max_tokens_in_staging(spec, shape, 256, ALIGN, ALIGN, 1000) == 0
