"""End to end with `--lynx-target int8`: the decode holds the INT8 reconstruction of the prompt
KV, so the reference is a single server whose prompt KV went through the same codec
(`lynx_sglang.reference_kv`, the `int8_reference_outputs` fixture); greedy outputs must be
token-identical to it. Agreement with full precision is printed (INT8 KV may legitimately
differ from it)."""

from __future__ import annotations

import pytest

from lynx_tools.client import generate
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def lynx_int8_cluster(sglang_model, start_cluster, pd_link, int8_codec):
    return start_cluster(ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link,
        server_args=tuple(int8_codec.to_flags()),
    ))


def test_lynx_int8_matches_int8_kv_reference(lynx_int8_cluster, int8_reference_outputs,
                                             reference_outputs, prompts, max_new_tokens):
    same_as_exact = 0
    for prompt in prompts:
        got = generate(lynx_int8_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert got.output_ids == int8_reference_outputs[prompt], prompt[:60]
        same_as_exact += got.output_ids == reference_outputs[prompt]
    print(f"lynx int8: {same_as_exact}/{len(prompts)} prompts identical to full precision")
