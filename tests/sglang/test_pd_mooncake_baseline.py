"""Baseline that proves the harness: SGLang PD (prefill + decode + router) with SGLang's own
`mooncake_tcp` backend gives greedy output_ids identical to a single server on this machine
(over a 1 Gbit/s shaped link between two network namespaces when run as root)."""

from __future__ import annotations

import pytest

from lynx_tools.client import generate
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def mooncake_cluster(sglang_model, start_cluster, pd_link):
    pytest.importorskip("mooncake", reason="mooncake-transfer-engine-non-cuda is not installed")
    return start_cluster(ClusterSpec(sglang_model, ClusterMode.PD, "mooncake_tcp", link=pd_link))


def test_pd_mooncake_tcp_matches_single_server(mooncake_cluster, reference_outputs, prompts,
                                               max_new_tokens):
    for prompt in prompts:
        got = generate(mooncake_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert len(got.output_ids) == max_new_tokens
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
