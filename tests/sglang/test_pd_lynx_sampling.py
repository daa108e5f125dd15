"""Speculative *sampling* through real SGLang PD: the answers keep the single full-precision
server's distribution although their speculative tokens were drawn on a coarse Anchor.

Cluster: 2-bit Anchor, nothing protected, no rotation (so the Anchor's distribution q differs from
the exact p), target exact, the Residual held back 0.5 s after each Anchor so the decode samples
speculative tokens before it can verify. `sampling_case` holds SAMPLING_N answers of the single
server (conftest). For each position the two samples are compared with a two-sample chi-square
test, at 0.1% for all positions together (Bonferroni; tokens seen fewer than 20 times pooled are
merged, so that every cell's expected count is at least 10 per sample); the acceptance rule's power
against "keep every draft" is shown in tests/sglang/test_acceptance.py. (At 0.1% per position, with
cells down to 5 expected, the test failed once in about 30 CI runs at position 0, which the
prefill samples from the same logits in both servers.)

Top-k/top-p/min-p sampling, and sampling with penalties, logit bias and min_new_tokens, are
checked on the same cluster, against requests of the same cluster that must wait for the Residual
(a `custom_params` entry, which SGLang's sampler ignores, makes them not speculable) and so decode
on exact KV only: no second server to start. Greedy decoding with penalties is checked the same
way, token for token.

`LYNX_SAMPLING_OVERLAP=1` runs the cluster on SGLang's overlap scheduler instead (a command, not
CI's run: docs/testing.md), where penalties are fed one step late and verification follows that.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from statistics import NormalDist

import pytest
from coarse_anchor import COARSE_ANCHOR_SPEC_ARGS
from sampling_case import (
    SAMPLING_N,
    SAMPLING_NEW_TOKENS,
    SAMPLING_PROMPT,
    SAMPLING_TEMPERATURE,
    sample_many,
)

from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV
from lynx_tools.client import generate
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def sampling_cluster(sglang_model, start_cluster, pd_link):
    return start_cluster(ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link,
        server_args=COARSE_ANCHOR_SPEC_ARGS,
        extra_env={FAULT_RESIDUAL_DELAY_ENV: "0.5"},
        overlap_schedule=os.environ.get("LYNX_SAMPLING_OVERLAP") == "1",
    ))


FAMILY_LEVEL = 0.001  # chance that a correct build fails the test, all positions together


def _chi2_critical(df: int, level: float = FAMILY_LEVEL) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile exceeded with probability
    `level`."""
    z = NormalDist().inv_cdf(1 - level)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_chi2(a: list[int], b: list[int], min_count: int = 20) -> tuple[float, int]:
    """Statistic and degrees of freedom for two equal-size samples of categories."""
    assert len(a) == len(b)
    ca, cb = Counter(a), Counter(b)
    keep = [k for k in ca.keys() | cb.keys() if ca[k] + cb[k] >= min_count]
    other_a = len(a) - sum(ca[k] for k in keep)
    other_b = len(b) - sum(cb[k] for k in keep)
    cells = [(ca[k], cb[k]) for k in keep] + [(other_a, other_b)]
    cells = [(x, y) for x, y in cells if x + y > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return stat, len(cells) - 1


def test_two_sample_chi2_flags_different_distributions():
    same = two_sample_chi2([1] * 80 + [2] * 80, [1] * 78 + [2] * 82)
    different = two_sample_chi2([1] * 120 + [2] * 40, [1] * 40 + [2] * 120)
    assert same[0] < _chi2_critical(same[1]) < different[0]
    # The Wilson-Hilferty quantiles against tabulated ones (0.1%: df 1 -> 10.83, df 5 -> 20.52).
    assert abs(_chi2_critical(1) / 10.83 - 1) < 0.04 and abs(_chi2_critical(5) / 20.52 - 1) < 0.04


def test_sampled_outputs_keep_the_single_server_distribution(sampling_cluster, sampling_case):
    log_path = sampling_cluster.log_path("decode")
    before = log_path.read_text(errors="replace").count("lynx spec ")
    ours = sample_many(sampling_cluster.url, SAMPLING_N, seed0=10_000)
    assert all(len(s) == sampling_case.max_new_tokens for s in ours)
    # The first token comes from the prefill's exact forward; positions 1.. were speculative.
    positions = sampling_case.max_new_tokens
    for pos in range(positions):
        stat, df = two_sample_chi2([s[pos] for s in ours],
                                   [s[pos] for s in sampling_case.samples])
        assert df == 0 or stat < _chi2_critical(df, FAMILY_LEVEL / positions), (pos, stat, df)
    lines = [json.loads(line.split("lynx spec ", 1)[1])
             for line in log_path.read_text(errors="replace").splitlines()
             if "lynx spec " in line][before:]
    # One line per request that speculated; a request whose Residual had landed by the time its
    # Anchor was processed goes straight to full precision and logs none.
    assert 0 < len(lines) <= SAMPLING_N
    # Sampled requests speculated, and the exact distribution rejected some drafts: the check
    # above compared verified samples, not a run where the Anchor happened to agree everywhere.
    assert sum(rec["speculated"] for rec in lines) > 0, lines[:3]
    assert sum(rec["rolled_back"] for rec in lines) > 0, lines[:3]


# Every filter active at once; at temperature 1 on SAMPLING_PROMPT each cuts some tokens.
FILTERS = {"top_k": 20, "top_p": 0.9, "min_p": 0.02}


# Every transformation SGLang's sampler applies before temperature: penalties on what was
# generated, a bias towards " a" (token 253 of SmolLM2's vocabulary) and EOS masked for two tokens.
PENALTIES = {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.3,
             "logit_bias": {"253": 1.5}, "min_new_tokens": 2}
EXACT_ONLY = {"custom_params": {"lynx_test_exact_only": True}}


def _generate_many(url: str, tag: str, prompts: list[str], max_new_tokens: int,
                   sampling: list[dict]) -> dict[str, tuple]:
    """One answer per (prompt, sampling) pair, by rid, 8 in flight."""
    stamp = time.monotonic_ns()

    def one(i: int) -> tuple[str, tuple[int, ...]]:
        rid = f"lynx-{tag}-{stamp}-{i}"
        got = generate(url, text=prompts[i], max_new_tokens=max_new_tokens, rid=rid,
                       sampling=sampling[i])
        return rid, tuple(got.output_ids)

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(one, range(len(prompts))))


def _sample_with(url: str, tag: str, seed0: int, params: dict) -> dict[str, tuple]:
    """SAMPLING_N answers to SAMPLING_PROMPT with `params`, by rid."""
    return _generate_many(url, tag, [SAMPLING_PROMPT] * SAMPLING_N, SAMPLING_NEW_TOKENS,
                          [{"temperature": SAMPLING_TEMPERATURE, "sampling_seed": seed0 + i,
                            **params} for i in range(SAMPLING_N)])


def _spec_records(log_path, before: int, rids) -> list[dict]:
    """The decode's `lynx spec` records after the first `before`, of the requests `rids`."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines()
             if "lynx spec " in line][before:]
    records = [json.loads(line.split("lynx spec ", 1)[1]) for line in lines]
    return [rec for rec in records if rec["rid"] in rids]


def _check_speculated_sampling(cluster, params: dict, seed0: int) -> None:
    """SAMPLING_N speculating answers with `params` against SAMPLING_N of the same cluster's
    requests that wait for the Residual: same distribution at every position (chi-square,
    Bonferroni), and the speculating ones did speculate and had drafts rolled back."""
    log_path = cluster.log_path("decode")
    before = log_path.read_text(errors="replace").count("lynx spec ")
    exact = _sample_with(cluster.url, "exact", seed0, params | EXACT_ONLY)
    ours = _sample_with(cluster.url, "spec", seed0 + 10_000, params)
    samples = {name: list(answers.values()) for name, answers in (("exact", exact), ("ours", ours))}
    assert all(len(s) == SAMPLING_NEW_TOKENS for group in samples.values() for s in group)
    for pos in range(SAMPLING_NEW_TOKENS):
        stat, df = two_sample_chi2([s[pos] for s in samples["ours"]],
                                   [s[pos] for s in samples["exact"]])
        critical = _chi2_critical(df, FAMILY_LEVEL / SAMPLING_NEW_TOKENS) if df else 0.0
        print(f"position {pos}: chi2 {stat:.2f}, df {df}, critical {critical:.2f}")
        assert df == 0 or stat < critical, (pos, stat, df)
    mine = _spec_records(log_path, before, ours)
    waited = _spec_records(log_path, before, exact)
    speculated = sum(rec["speculated"] for rec in mine)
    rolled_back = sum(rec["rolled_back"] for rec in mine)
    print(f"speculated {speculated}, accepted {speculated - rolled_back}, rolled back "
          f"{rolled_back} in {len(mine)} speculating requests")
    # The reference never speculated; the others did, and had drafts rolled back.
    assert all(rec["speculated"] == 0 and rec["no_spec_reason"] for rec in waited), waited[:3]
    assert all(rec["no_spec_reason"] is None for rec in mine), mine[:3]
    assert speculated > 0 and rolled_back > 0, mine[:3]


def test_filtered_sampling_speculates_and_keeps_the_exact_distribution(sampling_cluster):
    _check_speculated_sampling(sampling_cluster, FILTERS, 20_000)


def test_penalized_sampling_speculates_and_keeps_the_exact_distribution(sampling_cluster):
    _check_speculated_sampling(sampling_cluster, PENALTIES, 40_000)


def test_penalized_greedy_speculates_and_equals_exact_decoding(sampling_cluster, prompts,
                                                               max_new_tokens, reference_outputs):
    """Greedy with PENALTIES, token for token: speculating requests against requests of the same
    cluster that wait for the Residual (SGLang's own penalty pipeline on exact KV). The penalties
    change the answers (against the single server's greedy ones without them)."""
    log_path = sampling_cluster.log_path("decode")
    before = log_path.read_text(errors="replace").count("lynx spec ")
    chosen = list(prompts[:3])
    greedy = {"temperature": 0.0, "ignore_eos": True, **PENALTIES}
    exact = _generate_many(sampling_cluster.url, "greedy-exact", chosen, max_new_tokens,
                           [greedy | EXACT_ONLY] * len(chosen))
    ours = _generate_many(sampling_cluster.url, "greedy-spec", chosen, max_new_tokens,
                          [greedy] * len(chosen))
    assert list(ours.values()) == list(exact.values())
    assert any(list(out) != reference_outputs[p] for p, out in zip(chosen, ours.values(),
                                                                    strict=True))
    mine = _spec_records(log_path, before, ours)
    speculated = sum(rec["speculated"] for rec in mine)
    rolled_back = sum(rec["rolled_back"] for rec in mine)
    print(f"greedy: speculated {speculated}, rolled back {rolled_back} in {len(mine)} requests")
    assert all(rec["no_spec_reason"] is None for rec in mine), mine[:3]
    assert speculated > 0 and rolled_back > 0, mine
