"""`lynx_tools.load`: the request mix of a load round and what makes a round clean (no
servers)."""

from __future__ import annotations

from lynx_tools.load import NEW_TOKENS, LoadReport, plan_requests
from lynx_tools.process_tree import FD_SLACK, THREAD_SLACK, Resources


def test_the_mix_covers_every_prompt_and_abandons_about_the_asked_fraction():
    prompts = {n: [n] * n for n in (10, 20, 30, 40)}
    reqs = plan_requests(prompts, 256, abandon_fraction=0.25, seed=3)
    assert {len(r.prompt) for r in reqs} == set(prompts)
    assert {r.max_new_tokens for r in reqs} == set(NEW_TOKENS)
    abandoned = [r for r in reqs if r.abandon_after is not None]
    assert 0.15 < len(abandoned) / len(reqs) < 0.35
    assert all(0 <= r.abandon_after <= 3 for r in abandoned)
    # Same seed, same round; another seed, another set of abandoned requests.
    assert plan_requests(prompts, 256, 0.25, seed=3) == reqs
    assert plan_requests(prompts, 256, 0.25, seed=4) != reqs
    assert not any(r.abandon_after is not None for r in plan_requests(prompts, 64, 0.0, seed=1))


def test_a_round_is_clean_only_without_any_finding():
    assert LoadReport(4, 1, completed=3).clean
    assert not LoadReport(4, 1, leaked_decode_slots=2).clean
    assert not LoadReport(4, 1, staging_used_bytes={"http://d": 4096.0}).clean
    assert not LoadReport(4, 1, errors=["request 2: HTTP 500"]).clean
    assert not LoadReport(4, 1, mismatches=[{"request": 0}]).clean
    assert not LoadReport(4, 1, grown=["decode"]).clean


def test_resources_grow_only_past_the_slack():
    base = Resources(threads=100, fds=200, rss_mib=900.0)
    assert not Resources(100 + THREAD_SLACK, 200 + FD_SLACK, 5000.0).grown_past(base)
    assert Resources(101 + THREAD_SLACK, 200, 900.0).grown_past(base)
    assert Resources(100, 201 + FD_SLACK, 900.0).grown_past(base)
