"""End to end through real SGLang with staging smaller than one request (`backend.window`): on both
servers 32 MiB of staging, which holds ~590 tokens of SmolLM2's exact-target KV whole (the CPU
engine's KV pool is fp32 here, as in the single server the references come from). The short
prompts of the e2e suite go whole, the ~670-token one in segments through two windows of a quarter,
and a prompt at SmolLM2's 8k context (~440 MB of staging) in segments of one layer through two
windows of a half; greedy outputs must be token-identical to a single server's, and both servers'
staging back to idle afterwards."""

from __future__ import annotations

import re
import time

import pytest
from transformers import AutoTokenizer

from lynx_sglang.names import TRANSFER_RECORD, parse_records
from lynx_sglang.tools.client import generate
from lynx_sglang.tools.cluster import Cluster, ClusterMode, ClusterSpec
from lynx_sglang.tools.measure import metric_sum
from lynx_sglang.tools.prompts import passkey_prompt

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

STAGING_MIB = 32
# SmolLM2's context is 8192 tokens (the cluster's --max-total-tokens too): the prompt and its
# output tokens fit.
LONG_TOKENS = 8192 - 32


@pytest.fixture(scope="module")
def long_prompt(sglang_model) -> list[int]:
    return passkey_prompt(AutoTokenizer.from_pretrained(sglang_model), LONG_TOKENS)


@pytest.fixture(scope="module")
def long_reference(sglang_model, long_prompt, max_new_tokens, tmp_path_factory) -> list[int]:
    spec = ClusterSpec(sglang_model, ClusterMode.SINGLE,
                       run_dir=tmp_path_factory.mktemp("single_long"),
                       server_args=("--disable-radix-cache",))
    with Cluster(spec) as cluster:
        return generate(cluster.url, input_ids=long_prompt,
                        max_new_tokens=max_new_tokens).output_ids


@pytest.fixture(scope="module")
def windowed_cluster(sglang_model, start_cluster, pd_link):
    # The decode holds SGLang's reserve of decode tokens (512) beside a request: with a pool of
    # the context's 8192 it never admitted the 8k prompt (the prefill's bootstrap timed out).
    return start_cluster(ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link, max_total_tokens=8192 + 1024,
        server_args=("--lynx-target", "exact", "--lynx-staging-mib", str(STAGING_MIB),
                     "--enable-metrics")))


def test_requests_longer_than_staging_go_in_segments_and_match(
        windowed_cluster, reference_outputs, prompts, long_prompt, long_reference,
        max_new_tokens):
    for prompt in prompts:
        got = generate(windowed_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
    got = generate(windowed_cluster.url, input_ids=long_prompt, max_new_tokens=max_new_tokens,
                   timeout_s=600.0)
    assert got.output_ids == long_reference
    log = windowed_cluster.log_path("decode").read_text(errors="replace")
    cuts = re.findall(r"room (\d+) needs \d+ B of staging, more than the pool \(\d+ B\): "
                      r"sent in (\d+) segments of (\d+) layers through (\d+) windows", log)
    assert len(cuts) == 2, log[-3000:]
    assert int(cuts[0][1]) > 1 and cuts[0][3] == "2"  # ~670 tokens: two windows of a quarter
    assert cuts[1][2:] == ("1", "2")  # 8k tokens: a layer per segment, two windows of a half
    # Windowed rooms never speculate; the short prompts' rooms were not windowed.
    records = {r["room"]: r for r in parse_records(log, TRANSFER_RECORD)}
    assert len(records) == len(prompts) + 1
    windowed = [records[int(room)] for room, *_ in cuts]
    assert all(r["speculate"] is False for r in windowed), windowed
    assert windowed[1]["tokens"] == LONG_TOKENS
    # The prefill frees a range once the decode acknowledged it (its reaper runs every 50 ms).
    urls = (windowed_cluster.prefill_url, windowed_cluster.decode_url)
    deadline = time.monotonic() + 10.0
    while (used := [metric_sum(u, "lynx_staging_used_bytes") for u in urls]) != [0, 0]:
        assert time.monotonic() < deadline, used
        time.sleep(0.2)
