"""End to end through real SGLang with staging smaller than one request: the longest prompt
(~600 tokens, ~18 MB of exact-target staging) goes through 8 MiB of staging on both servers in
segments of whole layers taking turns in two windows (`backend.window`); greedy outputs must be
token-identical to a single server's, and both servers' staging back to idle afterwards."""

from __future__ import annotations

import re
import time

import pytest

from lynx_sglang.names import TRANSFER_RECORD, parse_records
from lynx_sglang.tools.client import generate
from lynx_sglang.tools.cluster import ClusterMode, ClusterSpec
from lynx_sglang.tools.measure import metric_sum

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

STAGING_MIB = 8


@pytest.fixture(scope="module")
def windowed_cluster(sglang_model, start_cluster, pd_link):
    return start_cluster(ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link,
        server_args=("--lynx-target", "exact", "--lynx-staging-mib", str(STAGING_MIB),
                     "--enable-metrics")))


def test_a_request_longer_than_staging_goes_in_segments_and_matches(
        windowed_cluster, reference_outputs, prompts, max_new_tokens):
    for prompt in prompts:
        got = generate(windowed_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
    log = windowed_cluster.log_path("decode").read_text(errors="replace")
    cut = re.search(r"sent in (\d+) segments of (\d+) layers through (\d+) windows", log)
    assert cut is not None and int(cut[1]) > 1 and cut[3] == "2", log[-3000:]
    # The windowed room never speculated; the short prompts' rooms were not windowed.
    records = parse_records(log, TRANSFER_RECORD)
    assert len(records) >= len(prompts)
    windowed = [r for r in records if r["anchor_bytes"] + r["residual_bytes"] > STAGING_MIB << 20]
    assert windowed and all(r["speculate"] is False for r in windowed), records
    # The prefill frees a range once the decode acknowledged it (its reaper runs every 50 ms).
    urls = (windowed_cluster.prefill_url, windowed_cluster.decode_url)
    deadline = time.monotonic() + 10.0
    while (used := [metric_sum(u, "lynx_staging_used_bytes") for u in urls]) != [0, 0]:
        assert time.monotonic() < deadline, used
        time.sleep(0.2)
