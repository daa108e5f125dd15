"""Lynx under SGLang's defaults: the overlap scheduler and the prefill's radix cache, through real
PD (prefill + decode + router, CPU).

Every other end-to-end module passes `--disable-overlap-schedule`. Here both servers run SGLang's
overlap schedule, where the decode launches step N+1 before it processes step N's results, and
the prefill keeps its radix cache. The Anchor is coarse and the prefill holds each Residual back
RESIDUAL_DELAY_S (test_pd_lynx_spec's knobs), short enough that it lands while the request is
still decoding: the decode speculates, rolls back, and verifies requests whose decode step is in
flight (`speculation.controller.IN_FLIGHT_PARK_REASON`). Of PROMPTS, the third shares a long
prefix with the second and the fourth repeats the first: the prefill sends their cached prefix
early (SGLang's `maybe_send_cached_prefix_chunk`, which on CPU needs `lynx_sglang.upstream.cpu_compat`'s
event). Every answer must be token-identical to a single server with the same SGLang flags, sent
the same prompts in the same order (so both radix caches hold the same prefixes). The prefill
streams layer by layer under overlap too (`backend.prefill.layer_stream`): every prompt its forward
computes, the one with a cached prefix included; the fully cached repeat goes after its forward.

One PD cluster and one single server for the module, started together; the single server stops
once it has answered.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from coarse_anchor import COARSE_ANCHOR_SPEC_ARGS
from layer_streaming import ALWAYS_STREAM

from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV, TRACE_DIR_ENV
from lynx_sglang.speculation.controller import IN_FLIGHT_PARK_REASON
from lynx_sglang.trace import read_records
from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

CONTEXT = " ".join(f"Item {i}: the value of key k{i} is {i * 37 % 101}." for i in range(24))
PROMPTS = (
    "The capital of France is",
    CONTEXT + " Question: what is the value of key k17? Answer:",
    CONTEXT + " Question: what is the value of key k5? Answer:",
    "The capital of France is",
)
# Long enough that the Residual lands before the last decode step even on a quiet machine
# (measured here, 2 busy cores: ~0.1 s a step, and the Residual applied 0.3-0.8 s after its hold).
MAX_NEW_TOKENS = 24
# Long enough for a few decode steps on the Anchor.
RESIDUAL_DELAY_S = 0.5


@dataclass(frozen=True)
class Runs:
    reference: list[list[int]]
    pd: list[list[int]]
    pd_cluster: Cluster
    trace_dir: Path


@pytest.fixture(scope="module")
def runs(sglang_model, start_cluster, pd_link, tmp_path_factory) -> Runs:
    single = ClusterSpec(sglang_model, ClusterMode.SINGLE, overlap_schedule=True,
                         run_dir=tmp_path_factory.mktemp("single"))
    trace_dir = tmp_path_factory.mktemp("trace")
    pd = ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link, overlap_schedule=True,
        # The cap above MAX_NEW_TOKENS: speculation ends when the Residual lands, not at a cap.
        server_args=(*COARSE_ANCHOR_SPEC_ARGS, "--lynx-spec-max-tokens", str(MAX_NEW_TOKENS + 1),
                     *ALWAYS_STREAM),
        extra_env={FAULT_RESIDUAL_DELAY_ENV: str(RESIDUAL_DELAY_S),
                   TRACE_DIR_ENV: str(trace_dir)},
    )
    with ThreadPoolExecutor(1) as pool:
        pd_started = pool.submit(start_cluster, pd)
        with Cluster(single) as server:
            reference = [_greedy(server.url, prompt) for prompt in PROMPTS]
        cluster = pd_started.result()
    return Runs(reference, [_greedy(cluster.url, prompt) for prompt in PROMPTS], cluster,
                trace_dir)


def _greedy(url: str, prompt: str) -> list[int]:
    return generate(url, text=prompt, max_new_tokens=MAX_NEW_TOKENS).output_ids


def _log(cluster: Cluster, name: str) -> str:
    return cluster.log_path(name).read_text(errors="replace")


def test_greedy_identical_to_a_single_server(runs):
    for prompt, got, want in zip(PROMPTS, runs.pd, runs.reference, strict=True):
        assert got == want, prompt[:60]


def test_speculation_rolls_back_and_waits_for_the_step_in_flight(runs):
    marker = "lynx spec "
    lines = [json.loads(line.split(marker, 1)[1])
             for line in _log(runs.pd_cluster, "decode").splitlines() if marker in line]
    assert len(lines) == len(PROMPTS), lines
    assert all(rec["speculated"] > 0 for rec in lines), lines
    # A finish held for verification drops the token of the step that overshot it: no request
    # speculates past max_new_tokens (the first token is the prefill's).
    assert all(rec["speculated"] < MAX_NEW_TOKENS for rec in lines), lines
    assert sum(rec["rolled_back"] for rec in lines) > 0, lines
    # A Residual landed while its request had a decode step in flight: verified one step later.
    assert any(rec["parked_reason"] == IN_FLIGHT_PARK_REASON for rec in lines), lines


def test_prefill_sent_cached_prefixes(runs):
    log = _log(runs.pd_cluster, "prefill")
    cached = [int(n) for n in re.findall(r"#cached-token: (\d+)", log)]
    # The shared context of prompts 2 and 3, and prompt 1 again (all but its last token).
    assert sum(n > 0 for n in cached) >= 2, cached
    # SGLang's CUDA event of that early send (lynx_sglang.upstream.cpu_compat gives the prefill a CPU one).
    assert "Tried to instantiate dummy base class Event" not in log


def test_prefill_streams_layers_during_the_forward_under_overlap(runs):
    """The overlap scheduler hands forward N's rooms over after launching forward N+1; the
    rooms still go to their decode as forward N starts and each layer as the forward writes it.
    (Before, overlap turned layer streaming off: every room was sent after its forward.)"""
    log = _log(runs.pd_cluster, "prefill")
    opened = re.search(r"first streamed forward opened (\d+) of (\d+) layers", log)
    assert opened is not None and opened[1] == opened[2], log[-2000:]
    records = [r for r in read_records(runs.trace_dir) if r["kind"] == "prefill"]
    assert len(records) == len(PROMPTS), records
    # Prompts 1-3, the third with its cached prefix already in the pool; not the fourth, fully
    # cached (its last token computed again, and swapped for the cache's copy: sent after).
    streamed = [r for r in records if r["facts"].get("layer_streamed")]
    assert len(streamed) == len(PROMPTS) - 1, [r["facts"] for r in records]
    # Sent before SGLang handed the room over: the first Anchor layer's encode began before
    # `send` (measured: 0.05-1.2 s before; the long prompt's forward leaves the most).
    assert any(r["spans"]["encode_anchor"][0][1] < r["marks"]["submitted"] for r in streamed), \
        [(r["spans"]["encode_anchor"][0], r["marks"]) for r in streamed]


PENALTIES = {"frequency_penalty": 0.6, "presence_penalty": 0.4, "repetition_penalty": 1.2,
             "min_new_tokens": 3}


def test_penalized_requests_speculate_and_match_ones_that_waited(runs):
    """Under overlap SGLang feeds each output token to the penalizers one step late;
    verification builds the exact rows in that order and a verified request resumes with the
    state its uninterrupted decoding would have (`speculation.penalties`). So a greedy
    penalized request that speculates (and rolls back) returns exactly what the same request
    returns when it waits for its Residual (`custom_params` keep it off speculation)."""
    marker = "lynx spec "
    cluster = runs.pd_cluster
    for i, prompt in enumerate(PROMPTS[:3]):
        spec = generate(cluster.url, text=prompt, max_new_tokens=MAX_NEW_TOKENS,
                        sampling=PENALTIES, rid=f"pen-spec-{i}").output_ids
        waited = generate(cluster.url, text=prompt, max_new_tokens=MAX_NEW_TOKENS,
                          sampling={**PENALTIES, "custom_params": {"lynx_test_exact_only": 1}},
                          rid=f"pen-wait-{i}").output_ids
        assert spec == waited, prompt[:60]
    lines = {rec["rid"]: rec for rec in (json.loads(line.split(marker, 1)[1])
                                         for line in _log(cluster, "decode").splitlines()
                                         if marker in line)}
    spec_recs = [lines[f"pen-spec-{i}"] for i in range(3)]
    assert all(r["no_spec_reason"] is None and r["speculated"] > 0 for r in spec_recs), spec_recs
    assert sum(r["rolled_back"] for r in spec_recs) > 0, spec_recs
    # (A waiting request has a line only if its Residual was still out when it was committed.)
    assert all(lines.get(f"pen-wait-{i}", {"speculated": 0})["speculated"] == 0
               for i in range(3))
