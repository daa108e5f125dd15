"""`lynx_tools.load.run` and `lynx_tools.load.mix`: the request mix of a load round, what makes a
round clean and the tally of what speculation did with each kind (no servers)."""

from __future__ import annotations

from lynx_tools.cluster.process_tree import FD_SLACK, THREAD_SLACK, Resources
from lynx_tools.load.run import NEW_TOKENS, LoadReport, plan_requests


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


def test_the_mix_takes_each_kind_in_turn_and_names_it_in_the_rid():
    from lynx_tools.load.mix import KINDS, kinds_by_name, request_id

    prompts = {n: [n] * n for n in (10, 20, 30, 40)}
    reqs = plan_requests(prompts, 24, abandon_fraction=0.0, seed=1)
    assert [r.kind for r in reqs[:4]] == list(KINDS[:4])
    # 4 prompt lengths and 6 kinds (common divisor 2): still every kind meets every length.
    for kind in KINDS:
        assert {len(r.prompt) for r in reqs if r.kind is kind} == set(prompts), kind.name
    two = kinds_by_name("logprobs,greedy")
    assert [k.name for k in two] == ["logprobs", "greedy"]
    assert {r.kind.name for r in plan_requests(prompts, 6, 0.0, seed=1, kinds=two)} == {
        "logprobs", "greedy"}
    assert request_id(2, 7, two[0]) == "load-r2-7.logprobs"
    for bad in ("greedy,beam", ""):
        try:
            kinds_by_name(bad)
        except ValueError as exc:
            assert "choose from greedy, logprobs" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_the_tally_counts_each_kinds_speculation_from_the_decode_log():
    import json

    from lynx_tools.load.mix import merged_tallies, speculation_summary, tally

    def line(rid, reason=None, speculated=3):
        return "x lynx spec " + json.dumps({"rid": rid, "no_spec_reason": reason,
                                            "speculated": speculated})

    log = "\n".join([
        line("load-r0-0.greedy"), line("load-r0-1.logprobs", speculated=0),
        line("load-r0-4.penalties", reason="penalties under overlap"),
        line("load-r1-0.greedy"),  # another round
        line("other-request"), "unrelated line"])
    t = tally(log, 0)
    assert set(t) == {"greedy", "logprobs", "penalties"}
    assert (t["greedy"].speculated, t["greedy"].with_tokens) == (1, 1)
    assert (t["logprobs"].speculated, t["logprobs"].with_tokens) == (1, 0)
    assert t["penalties"].fraction == 0 and t["penalties"].waited == {
        "penalties under overlap": 1}
    both = merged_tallies([t, tally(log, 1)])
    assert both["greedy"].committed_early == 2
    summary = speculation_summary(both)
    assert summary.startswith("3/4 speculated (75 %)"), summary
    assert "penalties 0/1 (1 waited: penalties under overlap)" in summary
    assert speculation_summary({}) == "no request was committed at Anchor time"
