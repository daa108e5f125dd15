"""Speculative decoding on the Anchor through real SGLang PD (prefill + decode + router, CPU).

The cluster uses a deliberately coarse Anchor (2 bits, nothing protected, no rotation) so the
Anchor-precision KV often disagrees with the exact one and verification must roll back, and the
prefill holds every Residual back a few seconds after its Anchor (the sender's fault-injection
knob) so the decode speculates before it can verify. Target exact: every answer must still be
token-identical to a single full-precision server (`references`).

What each test reads from the decode's log: one `lynx spec {json}` line per verified request
(lynx_sglang.speculation) with the tokens speculated / accepted / rolled back, why the request was
parked, and how many model forward passes the verification took.
"""

from __future__ import annotations

import json

import pytest
from coarse_anchor import COARSE_ANCHOR_SPEC_ARGS
from request_fields import GRAMMAR_SAMPLING, LOGPROB_FIELDS

from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV, SPEC_PARKED_LOG
from lynx_sglang.speculation.stream import SpecStreamClient
from lynx_tools.client import GenerateError, generate, generate_stream
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec, free_port
from lynx_tools.measure import transfer_lines

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

RESIDUAL_DELAY_S = 3.0
SPEC_MAX_TOKENS = 10
# The decode's opt-in spec stream (only the decode publishes; the prefill ignores the flag).
SPEC_STREAM_PORT = free_port()


@pytest.fixture(scope="module")
def spec_cluster(sglang_model, start_cluster, pd_link):
    return start_cluster(ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link,
        server_args=(*COARSE_ANCHOR_SPEC_ARGS,
                     "--lynx-spec-max-tokens", str(SPEC_MAX_TOKENS), "--enable-metrics",
                     "--lynx-spec-stream-port", str(SPEC_STREAM_PORT)),
        extra_env={FAULT_RESIDUAL_DELAY_ENV: str(RESIDUAL_DELAY_S)},
    ))


def _spec_lines(cluster) -> list[dict]:
    log = cluster.log_path("decode").read_text(errors="replace")
    marker = "lynx spec "
    return [json.loads(line.split(marker, 1)[1]) for line in log.splitlines() if marker in line]


def _transfer_line(cluster, room: int) -> dict:
    """The decode's `lynx transfer {json}` line of a room (lynx_sglang.backend.manager: wall-clock times)."""
    (rec,) = [r for r in transfer_lines(cluster.log_path("decode").read_text(errors="replace"))
              if r["room"] == room]
    return rec


def test_greedy_identical_with_rollbacks_and_one_verify_forward(spec_cluster, reference_outputs,
                                                                prompts, max_new_tokens):
    before = len(_spec_lines(spec_cluster))
    for prompt in prompts:
        got = generate(spec_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
    lines = _spec_lines(spec_cluster)[before:]
    assert len(lines) == len(prompts), lines
    # The decode really speculated, the coarse Anchor made it wrong somewhere, and verification
    # repaired it: identical outputs above are not a run where nothing was speculative.
    assert all(rec["speculated"] > 0 for rec in lines), lines
    assert sum(rec["rolled_back"] for rec in lines) > 0, lines
    assert any(rec["corrected"] for rec in lines), lines
    # A request longer than the cap stops at the cap and waits for its Residual.
    assert any("cap" in (rec["parked_reason"] or "") for rec in lines), lines
    # Verification is one model forward however many speculative tokens it checks.
    multi = [rec for rec in lines if rec["speculated"] >= 2]
    assert multi, lines
    assert all(rec["verify_model_passes"] == 1 for rec in multi), multi
    # Where every draft was kept and no finish was held, the same forward gave the next token.
    kept_all = [rec for rec in lines if rec["speculated"] > 0 and rec["rolled_back"] == 0
                and not (rec["parked_reason"] or "").startswith("speculative finish")]
    assert all(rec["bonus"] for rec in kept_all), kept_all
    assert not any(rec["bonus"] and rec["corrected"] for rec in lines), lines


def test_stop_token_during_speculation_waits_for_verification(spec_cluster, stop_case,
                                                              max_new_tokens):
    before = len(_spec_lines(spec_cluster))
    got = generate(spec_cluster.url, text=stop_case.prompt, max_new_tokens=max_new_tokens,
                   sampling={"stop_token_ids": [stop_case.stop_token_id]})
    assert got.output_ids == stop_case.output_ids
    (rec,) = _spec_lines(spec_cluster)[before:]
    # Unless a rollback removed the speculative stop first, the finish was held for verification.
    assert (rec["parked_reason"] or "").startswith("speculative finish") or rec["rolled_back"], rec


def test_stream_carries_only_verified_tokens(spec_cluster, reference_outputs, prompts,
                                             max_new_tokens):
    before = len(_spec_lines(spec_cluster))
    prompt = prompts[-1]
    got = generate_stream(spec_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
    # generate_stream raises if a chunk ever took back a token; the ids must be the exact ones.
    assert got.output_ids == reference_outputs[prompt]
    (rec,) = _spec_lines(spec_cluster)[before:]
    assert rec["speculated"] > 0, rec


def test_logprob_requests_speculate_and_return_the_exact_logprobs(spec_cluster, prompts,
                                                                  reference_logprobs,
                                                                  reference_outputs,
                                                                  max_new_tokens):
    """A request asking for logprobs speculates like any other, and what it returns is the exact
    model's: each token's logprob and top 3 equal the single server's within float rounding
    (the verification's extend forward against its decode steps), far from what the 2-bit Anchor
    gives (rolled-back tokens would not even be the same tokens)."""

    before = len(_spec_lines(spec_cluster))
    for prompt in prompts[2:]:
        got = generate(spec_cluster.url, text=prompt, max_new_tokens=max_new_tokens,
                       fields=LOGPROB_FIELDS)
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
        ref = reference_logprobs[prompt]
        ours, theirs = got.meta["output_token_logprobs"], ref["output_token_logprobs"]
        assert [t[1] for t in ours] == [t[1] for t in theirs] == got.output_ids
        assert [t[0] for t in ours] == pytest.approx([t[0] for t in theirs], abs=2e-3)
        for mine, ref_top in zip(got.meta["output_top_logprobs"], ref["output_top_logprobs"],
                                 strict=True):
            assert [t[1] for t in mine] == [t[1] for t in ref_top]
            assert [t[0] for t in mine] == pytest.approx([t[0] for t in ref_top], abs=2e-3)
    recs = _spec_lines(spec_cluster)[before:]
    assert len(recs) == len(prompts[2:]), recs
    assert all(r["no_spec_reason"] is None for r in recs), recs
    assert sum(r["speculated"] for r in recs) > 0 and sum(r["rolled_back"] for r in recs) > 0, recs


def test_grammar_requests_speculate_and_stay_exact(spec_cluster, reference_grammar_outputs,
                                                   max_new_tokens):
    """A regex-constrained request (xgrammar) speculates: drafts are masked by the matcher as it
    advanced over them, verification masks each exact row as exact decoding would and rolls the
    matcher back to the verified output; the answer equals the single server's."""

    before = len(_spec_lines(spec_cluster))
    for prompt, want in reference_grammar_outputs.items():
        got = generate(spec_cluster.url, text=prompt, max_new_tokens=max_new_tokens,
                       sampling=GRAMMAR_SAMPLING)
        assert got.output_ids == want, prompt[:60]
    recs = _spec_lines(spec_cluster)[before:]
    assert len(recs) == len(reference_grammar_outputs), recs
    assert all(r["no_spec_reason"] is None for r in recs), recs
    assert sum(r["speculated"] for r in recs) > 0, recs


def test_spec_stream_reports_speculation_and_rollbacks(spec_cluster, reference_outputs, prompts,
                                                      max_new_tokens):
    """Opt-in stream (--lynx-spec-stream-port): provisional tokens reach the subscriber before
    their verification, every rollback is reported with the tokens it took back, the verified
    tokens are the exact ones, and SGLang's own answer is unchanged (verified tokens only)."""
    import time

    before = len(_spec_lines(spec_cluster))
    rids = {prompt: f"lynx-stream-{i}-{time.monotonic_ns()}" for i, prompt in enumerate(prompts)}
    with SpecStreamClient(spec_cluster.decode_tcp_address(SPEC_STREAM_PORT)) as sub:
        for rid in rids.values():
            sub.subscribe(rid)
        answers = {prompt: generate(spec_cluster.url, text=prompt, max_new_tokens=max_new_tokens,
                                    rid=rid) for prompt, rid in rids.items()}
        sub.poll(timeout_s=30)
    lines = {rec["rid"]: rec for rec in _spec_lines(spec_cluster)[before:]}
    rolled_back = 0
    for prompt, rid in rids.items():
        got, view = answers[prompt], sub.views[rid]
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
        events = [e for e in sub.events if e["rid"] == rid]
        assert view.done and events[-1]["type"] == "verified", events
        rec = lines[rid]
        # What the stream reported is what the decode did.
        assert events[-1]["speculated"] == rec["speculated"] > 0, (events[-1], rec)
        assert events[-1]["rolled_back"] == rec["rolled_back"], (events[-1], rec)
        speculative = [e for e in events if e["type"] == "speculative"]
        assert sum(len(e["token_ids"]) for e in speculative) == rec["speculated"], events
        # Provisional means early: the first speculative token went out before the Residual
        # (held back RESIDUAL_DELAY_S by the prefill) had even landed.
        transfer = _transfer_line(spec_cluster, rec["room"])
        assert speculative[0]["t"] < transfer["residual_landed"]
        # The transfer record names the request and says how long each stage took.
        assert transfer["rid"] == rid
        assert 0 < transfer["residual_wire_ms"] <= transfer["total_ms"], transfer
        assert transfer["anchor_apply_ms"] >= 0 and transfer["residual_apply_ms"] >= 0, transfer
        assert view.tokens == got.output_ids[:view.verified_len]
        for pos, taken in view.rollbacks:
            assert taken and len(taken) == rec["rolled_back"]
            # The first token taken back is where the exact KV disagreed: the correction differs.
            assert rec["corrected"] and taken[0] != got.output_ids[pos]
        rolled_back += rec["rolled_back"]
    assert rolled_back > 0, lines  # the coarse Anchor makes this happen (see the first test)


# Custom parameters (read by a custom logit processor, whose state Lynx cannot roll back) keep a
# request off speculation: it waits for its Residual.
EXACT_ONLY = {"custom_params": {"lynx_test_exact_only": True}}


def test_exact_only_request_waits_for_the_residual(spec_cluster, prompts, max_new_tokens):
    before = len(_spec_lines(spec_cluster))
    # ignore_eos: a sampled " Paris." + EOS once ended this request after 3 tokens.
    got = generate(spec_cluster.url, text=prompts[0], max_new_tokens=max_new_tokens,
                   sampling={"temperature": 0.8, "sampling_seed": 7, "ignore_eos": True,
                             **EXACT_ONLY})
    assert len(got.output_ids) == max_new_tokens
    (rec,) = _spec_lines(spec_cluster)[before:]
    assert rec["no_spec_reason"] == "a custom logit processor or custom parameters", rec
    assert rec["speculated"] == 0, rec


def test_abort_of_a_parked_request_frees_its_kv(spec_cluster, prompts):
    """SGLang's abort_request searches only its own queues; a parked request is Lynx's. An
    exact-only request parks at once and waits RESIDUAL_DELAY_S for its Residual; aborting it then must end
    its stream with an abort, cancel its transfer and give its KV slots back."""
    import threading
    import time
    import urllib.request

    rid = f"lynx-abort-{time.monotonic_ns()}"
    before = spec_cluster.decode_used_tokens()
    decode_log = spec_cluster.log_path("decode")
    result: dict = {}

    def client():
        try:
            result["gen"] = generate_stream(
                spec_cluster.url, text=prompts[-1], max_new_tokens=16, rid=rid, timeout_s=60,
                sampling={"temperature": 0.8, "sampling_seed": 3, "ignore_eos": True,
                          **EXACT_ONLY})
        except GenerateError as exc:
            result["error"] = exc

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 120
    while f"lynx spec: {rid} {SPEC_PARKED_LOG}" not in decode_log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the request never parked"
        assert t.is_alive(), f"the request ended before it parked: {result}"
        time.sleep(0.05)
    abort = urllib.request.Request(spec_cluster.decode_url + "/abort_request",
                                   data=json.dumps({"rid": rid}).encode(),
                                   headers={"content-type": "application/json"})
    urllib.request.urlopen(abort, timeout=10).close()
    t.join(timeout=60)
    assert not t.is_alive(), "the client hung after the abort"
    assert "error" in result, f"expected an abort, got {result.get('gen')}"
    log = decode_log.read_text(errors="replace")
    assert f"parked request {rid}" in log and "aborted (abort_request)" in log
    deadline = time.monotonic() + 30
    while spec_cluster.decode_used_tokens() != before:
        assert time.monotonic() < deadline, "decode KV usage did not return to its level"
        time.sleep(0.2)
    # The decode keeps serving.
    assert generate(spec_cluster.url, text=prompts[0], max_new_tokens=4).output_ids


def test_decode_metrics_count_speculation(spec_cluster):
    import urllib.request

    # Runs after the tests above sent their requests through this cluster.
    with urllib.request.urlopen(spec_cluster.decode_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    # Samples by name and their own labels (every series also carries model_name/role/tp_rank).
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lynx_") and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            assert 'role="decode"' in labels and 'tp_rank="0"' in labels, line
            own = [kv for kv in labels.rstrip("}").split(",")
                   if kv and not kv.startswith(("model_name=", "role=", "tp_rank="))]
            key = name + ("{" + ",".join(own) + "}" if own else "")
            values[key] = values.get(key, 0.0) + float(value)
    assert values.get('lynx_spec_tokens_total{fate="speculated"}', 0) > 0, values
    assert values.get('lynx_spec_tokens_total{fate="rolled_back"}', 0) > 0, values
    assert values.get('lynx_spec_requests_total{outcome="not_speculable"}', 0) >= 1, values
    assert values.get('lynx_stream_bytes_total{stream="anchor"}', 0) > 0, values
    assert values.get("lynx_anchor_to_residual_seconds_count", 0) >= 1, values
