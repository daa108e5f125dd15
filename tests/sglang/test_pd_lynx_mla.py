"""Lynx through real PD (prefill + decode + router, CPU) on an MLA model: a DeepSeek-V2-architecture
model of random weights (`--load-format dummy`: the same seeded weights in every server; its
config written here, the tokenizer the embedded SmolLM2's), whose KV pool is SGLang's
`MLATokenToKVPool` (one latent row per token and layer, no V). Greedy answers through Lynx must
be token-identical to a single server's, sent the same prompts in the same order. About 110 s on
2 busy cores (2026-12-06).

The model and why its widths are what they are: tiny_deepseek.py.
"""

from __future__ import annotations

import re

import pytest
from layer_streaming import ALWAYS_STREAM
from tiny_deepseek import DUMMY, MAX_NEW_TOKENS, PROMPTS, write_model

from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def mla_model(sglang_model, tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-deepseek-v2"), sglang_model)


def test_greedy_mla_output_is_token_identical_to_a_single_server(mla_model, pd_link,
                                                                  tmp_path_factory):
    single = ClusterSpec(mla_model, ClusterMode.SINGLE, server_args=DUMMY,
                         run_dir=tmp_path_factory.mktemp("single"))
    pd = ClusterSpec(mla_model, ClusterMode.PD, "lynx", link=pd_link,
                     server_args=(*DUMMY, *ALWAYS_STREAM),
                     run_dir=tmp_path_factory.mktemp("pd"))
    # One cluster at a time: two cores.
    with Cluster(single) as server:
        want = [generate(server.url, text=p, max_new_tokens=MAX_NEW_TOKENS).output_ids
                for p in PROMPTS]
    with Cluster(pd) as cluster:
        got = [generate(cluster.url, text=p, max_new_tokens=MAX_NEW_TOKENS,
                        rid=f"mla-{i}").output_ids for i, p in enumerate(PROMPTS)]
        logs = [cluster.log_path(role).read_text(errors="replace")
                for role in ("prefill", "decode")]
    assert got == want
    assert all(len(ids) == MAX_NEW_TOKENS for ids in want)  # random weights: no early EOS
    # Layer streaming opened every layer of the MLA pool during the prefill's forward.
    opened = re.search(r"first streamed forward opened (\d+) of (\d+) layers", logs[0])
    assert opened is not None and opened[1] == opened[2], logs[0][-2000:]
    # Both Lynx managers ran on SGLang's MLA pool.
    for log in logs:
        assert "lynx: MLA KV pool: a latent of 192 values per token and layer (128 + 64 rope), " \
               "coded as K in 3 heads of 64" in log
