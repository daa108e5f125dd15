"""End to end with chunked prefill: the prefill computes a long prompt in chunks of 128 tokens,
and Lynx streams the Anchor layer by layer during the forward of its last chunk (the earlier
chunks' KV is in the pool by then; `backend.prefill.layer_stream`). Greedy outputs must be
token-identical to a single server that chunks its prefill the same way; the same prompt a second
time (a prefix-cache hit on the prefill, whose radix cache is on here) likewise."""

from __future__ import annotations

import re

import pytest
from layer_streaming import ALWAYS_STREAM

from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

CHUNK = ("--chunked-prefill-size", "128")


@pytest.fixture(scope="module")
def long_prompts(prompts) -> list[str]:
    return [prompts[3], prompts[2]]  # ~600 tokens (5 chunks), and one chunk


@pytest.fixture(scope="module")
def chunked_references(sglang_model, long_prompts, max_new_tokens, tmp_path_factory):
    spec = ClusterSpec(sglang_model, ClusterMode.SINGLE,
                       run_dir=tmp_path_factory.mktemp("single_chunked"),
                       server_args=("--disable-radix-cache", *CHUNK))
    with Cluster(spec) as cluster:
        return {p: generate(cluster.url, text=p, max_new_tokens=max_new_tokens).output_ids
                for p in long_prompts}


@pytest.fixture(scope="module")
def chunked_cluster(sglang_model, start_cluster, pd_link):
    return start_cluster(ClusterSpec(sglang_model, ClusterMode.PD, "lynx", link=pd_link,
                                     server_args=("--lynx-target", "exact", *CHUNK,
                                                  *ALWAYS_STREAM)))


def test_chunked_prefill_streams_the_last_chunk_and_matches(chunked_cluster, chunked_references,
                                                            long_prompts, max_new_tokens):
    for prompt in (*long_prompts, long_prompts[0]):
        got = generate(chunked_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert got.output_ids == chunked_references[prompt], prompt[:60]
    log = chunked_cluster.log_path("prefill").read_text(errors="replace")
    opened = re.search(r"first streamed forward opened (\d+) of (\d+) layers", log)
    assert opened is not None and opened[1] == opened[2], log[-2000:]
    assert "sending room" not in log  # no room failed
