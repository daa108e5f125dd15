"""Lynx with `--page-size` > 1 through real PD (prefill + decode + router, CPU): SGLang hands the
backend page indices, which Lynx turns into token slots (lynx_sglang.backend.pages), and the
speculative decode allocates its bonus slot and frees rolled-back positions by page
(lynx_sglang.speculation.verify).

For each page size one PD cluster (coarse Anchor, Residual held back RESIDUAL_DELAY_S, so the
decode speculates SPEC_CAP tokens, parks, and verifies them with rollbacks and bonus tokens) and
one single server with the same page size, one after the other. The prompts' lengths are not
multiples of the page (a partial last page on both ends); the third and fifth share a long
prefix with the second and the fourth repeats it, so the prefill's radix cache hands over
shared, page-aligned prefix pages. The fifth's rollback frees a whole page. Every answer must
be token-identical to the single server's, sent the same prompts in the same order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from coarse_anchor import COARSE_ANCHOR_SPEC_ARGS

from lynx_sglang.backend.pages import page_ceil
from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV
from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

CONTEXT = " ".join(f"Item {i}: the value of key k{i} is {i * 37 % 101}." for i in range(24))
PROMPTS = (
    "The capital of France is",  # 5 tokens
    CONTEXT + " Question: what is the value of key k17? Answer:",  # 399
    CONTEXT + " Question: what is the value of key k5? Answer:",
    CONTEXT + " Question: what is the value of key k17? Answer:",
    # 381 tokens: its verification keeps 381 + 2 + 1 = 384 = 6 * 64 positions of the 385 held,
    # and frees the page that starts at 384 (with either page size).
    CONTEXT.split(" Item 23:")[0] + " Question: what is the value of key k1? Answer:",
)
MAX_NEW_TOKENS = 24
# Long enough for several decode steps on the Anchor (~0.1 s a step here).
RESIDUAL_DELAY_S = 1.0
# Measured with the 2-bit Anchor: the first prompt's first 4 drafts are right, the others' first
# 2, so a cap of 4 gives both a verification that keeps every draft (and takes the bonus token
# in a slot of the request's last page) and ones that roll back.
SPEC_CAP = 4


@dataclass(frozen=True)
class Runs:
    page_size: int
    reference: list[list[int]]
    pd: list[list[int]]
    prompt_tokens: list[int]
    decode_log: str
    prefill_log: str


@pytest.fixture(scope="module", params=(16, 64), ids=lambda p: f"page{p}")
def runs(request, sglang_model, pd_link, tmp_path_factory) -> Runs:
    page = ("--page-size", str(request.param))
    single = ClusterSpec(sglang_model, ClusterMode.SINGLE, server_args=page,
                         run_dir=tmp_path_factory.mktemp("single"))
    pd = ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link,
        run_dir=tmp_path_factory.mktemp("pd"),
        server_args=(*COARSE_ANCHOR_SPEC_ARGS, "--lynx-spec-max-tokens", str(SPEC_CAP), *page),
        extra_env={FAULT_RESIDUAL_DELAY_ENV: str(RESIDUAL_DELAY_S)},
    )
    # One cluster at a time: two cores.
    with Cluster(single) as server:
        answers = [generate(server.url, text=p, max_new_tokens=MAX_NEW_TOKENS) for p in PROMPTS]
    with Cluster(pd) as cluster:
        got = [generate(cluster.url, text=prompt, max_new_tokens=MAX_NEW_TOKENS,
                        rid=f"paged-{i}").output_ids for i, prompt in enumerate(PROMPTS)]
        logs = [cluster.log_path(name).read_text(errors="replace")
                for name in ("decode", "prefill")]
    return Runs(request.param, [a.output_ids for a in answers], got,
                [int(a.meta["prompt_tokens"]) for a in answers], *logs)


def test_greedy_identical_to_a_single_server_with_the_same_page_size(runs):
    # Every prompt ends inside a page: the partial last page is exercised.
    assert all(n % runs.page_size for n in runs.prompt_tokens), runs.prompt_tokens
    for prompt, got, want in zip(PROMPTS, runs.pd, runs.reference, strict=True):
        assert got == want, prompt[:60]


def test_speculation_rolled_back_and_took_a_bonus_by_page(runs):
    marker = "lynx spec "
    lines = [json.loads(line.split(marker, 1)[1])
             for line in runs.decode_log.splitlines() if marker in line]
    assert len(lines) == len(PROMPTS), lines
    assert all(rec["speculated"] > 0 for rec in lines), lines
    assert sum(rec["rolled_back"] for rec in lines) > 0, lines
    assert any(rec["bonus"] for rec in lines), lines
    # A verification kept fewer positions than a page boundary below what it held: the page
    # past the boundary went back whole (`verify.free_kv_past_output`).
    freed_a_page = []
    for rec in lines:
        prompt_len = runs.prompt_tokens[int(rec["rid"].removeprefix("paged-"))]
        kept = prompt_len + rec["accepted"] + 1
        if rec["corrected"] and page_ceil(kept, runs.page_size) < prompt_len + rec["speculated"]:
            freed_a_page.append(rec)
    assert freed_a_page, lines


def test_prefill_sent_cached_prefix_pages(runs):
    cached = [int(n) for n in re.findall(r"#cached-token: (\d+)", runs.prefill_log)]
    # The shared context of prompts 2 and 3, and prompt 1 again: whole pages only.
    hits = [n for n in cached if n > 0]
    assert len(hits) >= 2, cached
    assert all(n % runs.page_size == 0 for n in hits), hits
