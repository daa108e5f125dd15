"""Lynx with tensor parallelism through real PD on this CPU (SGLang's CPU TP over gloo): a TP 2
prefill and a TP 2 decode, one Lynx transport session per prefill/decode rank pair, each rank
pair moving its own half of the KV heads.

The embedded SmolLM2-135M has 9 query and 3 KV heads, which TP 2 cannot split, so the module
builds its own model once: the embedded weights with the first 2 KV heads (and their 6 query
heads) of every layer kept, a real checkpoint (prompt-dependent output, identical on every load).
One single TP 2 server gives the reference, then one PD cluster (TP 2 + TP 2, `lynx`, target
exact); every greedy answer must be token-identical. (On loopback each Residual lands before its
Anchor is applied, so these requests do not speculate.) Then a TP 1 prefill with a TP 2 decode
(each decode rank gets its half of the heads, `backend.heads`), token-identical to SGLang's
`mooncake_tcp` on the same sizes; and a TP 2 prefill with a TP 1 decode (the decode's rank fills
each half of its heads from one prefill rank, `backend.heads.source_slices`), token-identical to
`mooncake_tcp` on those sizes too.

SGLang's CPU engine binds each rank's OpenMP threads to cores: with more ranks than NUMA nodes it
refuses to start unless SGLANG_CPU_OMP_THREADS_BIND names one core list per rank ("0|1" here).
Skips where the box has fewer than 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TP = 2
# SGLang's CPU engine: one core list per rank, as many lists as ranks.
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
KV_HEADS_KEPT = 2
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # Over one Lynx chunk (256 tokens): several chunks per rank.
    " ".join(f"Item {i}: the value of key k{i} is {i * 37 % 101}." for i in range(30))
    + " Question: what is the value of key k17? Answer:",
)
MAX_NEW_TOKENS = 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "chat_template.jinja")


def build_tp2_model(source: Path, dest: Path) -> Path:
    """`source` (a Llama checkpoint whose KV heads TP 2 cannot split) with only the first
    KV_HEADS_KEPT KV heads, and the query heads that share them, in every layer."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    head_dim = config["head_dim"]
    q_rows, kv_rows = KV_HEADS_KEPT * group * head_dim, KV_HEADS_KEPT * head_dim
    weights = {}
    for name, w in load_file(source / "model.safetensors").items():
        if name.endswith("q_proj.weight"):
            w = w[:q_rows]
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            w = w[:kv_rows]
        elif name.endswith("o_proj.weight"):
            w = w[:, :q_rows]
        weights[name] = w.contiguous()
    dest.mkdir(parents=True)
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    config.update(num_attention_heads=KV_HEADS_KEPT * group, num_key_value_heads=KV_HEADS_KEPT)
    (dest / "config.json").write_text(json.dumps(config))
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def tp_model(sglang_model, tmp_path_factory) -> str:
    if (os.cpu_count() or 1) < TP:
        pytest.skip(f"TP {TP} on CPU binds one core per rank: this box has {os.cpu_count()}")
    return str(build_tp2_model(Path(sglang_model), tmp_path_factory.mktemp("tp") / "model"))


def _tp_spec(model: str, mode: ClusterMode, run_dir: Path, prefill_tp: int = TP,
             decode_tp: int = TP, server_args: tuple[str, ...] = ()) -> ClusterSpec:
    return ClusterSpec(
        model, mode, "lynx", run_dir=run_dir,
        server_args=server_args if mode is ClusterMode.PD else ("--tp", str(TP)),
        role_args={"prefill": ("--tp", str(prefill_tp)), "decode": ("--tp", str(decode_tp))}
        if mode is ClusterMode.PD else {},
        extra_env={THREADS_BIND_ENV: "|".join(str(core) for core in range(TP))},
        # Four TP ranks on two cores start slowly.
        startup_timeout_s=600.0,
    )


@pytest.fixture(scope="module")
def tp_runs(tp_model, tmp_path_factory):
    # One cluster at a time: two cores.
    with Cluster(_tp_spec(tp_model, ClusterMode.SINGLE, tmp_path_factory.mktemp("single"))) as s:
        reference = [generate(s.url, text=p, max_new_tokens=MAX_NEW_TOKENS).output_ids
                     for p in PROMPTS]
    pd = _tp_spec(tp_model, ClusterMode.PD, tmp_path_factory.mktemp("pd"),
                  server_args=("--lynx-target", "exact"))
    with Cluster(pd) as c:
        got = [generate(c.url, text=p, max_new_tokens=MAX_NEW_TOKENS, timeout_s=300).output_ids
               for p in PROMPTS]
        logs = {name: c.log_path(name).read_text(errors="replace")
                for name in ("prefill", "decode")}
    return reference, got, logs


def test_tp2_pd_greedy_identical_to_a_tp2_single_server(tp_runs):
    reference, got, _ = tp_runs
    for prompt, want, have in zip(PROMPTS, reference, got, strict=True):
        assert len(have) == MAX_NEW_TOKENS
        assert have == want, prompt[:60]


def test_one_transport_session_per_rank_pair(tp_runs):
    _, _, logs = tp_runs
    # Each decode rank's session comes from its own prefill rank (rank ip:port).
    sessions = set(re.findall(r"\[[^]]* TP(\d)\] lynx: transport session from prefill rank (\S+)",
                              logs["decode"]))
    assert sorted(rank for rank, _ in sessions) == [str(r) for r in range(TP)], sessions
    assert len({prefill for _, prefill in sessions}) == TP, sessions


def _unequal_matches_mooncake(tp_model: str, tmp_path_factory, prefill_tp: int,
                              decode_tp: int) -> str:
    """One PD cluster of these TP sizes per backend, `mooncake_tcp` then `lynx` (target exact),
    the same prompts; every greedy answer must be Lynx's and Mooncake's alike, and both Lynx
    servers alive after. Returns the Lynx decode's log."""
    answers = {}
    tag = f"p{prefill_tp}d{decode_tp}"
    for backend in ("mooncake_tcp", "lynx"):
        spec = _tp_spec(tp_model, ClusterMode.PD, tmp_path_factory.mktemp(f"{tag}-{backend}"),
                        prefill_tp, decode_tp,
                        ("--lynx-target", "exact") if backend == "lynx" else ())
        spec = dataclasses.replace(spec, transfer_backend=backend)
        with Cluster(spec) as c:
            answers[backend] = [generate(c.url, text=p, max_new_tokens=MAX_NEW_TOKENS,
                                         timeout_s=300).output_ids for p in PROMPTS]
            if backend == "lynx":
                decode_log = c.log_path("decode").read_text(errors="replace")
                for name in ("prefill", "decode"):
                    assert c.proc(name).poll() is None, f"the {name} server died"
    for prompt, want, have in zip(PROMPTS, answers["mooncake_tcp"], answers["lynx"], strict=True):
        assert len(have) == MAX_NEW_TOKENS
        assert have == want, prompt[:60]
    return decode_log


def test_prefill_tp1_to_decode_tp2_slices_heads_as_mooncake_does(tp_model, tmp_path_factory):
    """A TP 1 prefill and a TP 2 decode: each decode rank gets its own half of the KV heads,
    encoded from the prefill's pool by head (`backend.heads`). The reference is SGLang's own
    `mooncake_tcp` on the same TP sizes (raw KV bytes, head-sliced by SGLang): an exact Lynx
    transfer leaves the decode the same KV, so the same tokens. (Neither TP 1 nor TP 2 single
    servers are: the prefill's KV comes from a TP 1 forward, the decode steps at TP 2.)"""
    decode_log = _unequal_matches_mooncake(tp_model, tmp_path_factory, 1, 2)
    # Both decode ranks had their own session from the one prefill rank.
    ranks = set(re.findall(r"\[[^]]* TP(\d)\] lynx: transport session from prefill rank",
                           decode_log))
    assert ranks == {"0", "1"}, ranks


def test_prefill_tp2_to_decode_tp1_fills_each_half_from_its_prefill_rank(tp_model,
                                                                       tmp_path_factory):
    """A TP 2 prefill and a TP 1 decode: the decode's one rank reads from both prefill ranks,
    each sending all of its KV heads into its own half of the decode's heads (one room part per
    prefill rank, `backend.heads.source_slices`). Token-identical to SGLang's `mooncake_tcp` on
    the same sizes, both prefill ranks with their own session to the decode."""
    decode_log = _unequal_matches_mooncake(tp_model, tmp_path_factory, 2, 1)
    sessions = set(re.findall(r"lynx: transport session from prefill rank (\S+)", decode_log))
    assert len(sessions) == TP, sessions
    # Every room came in two parts, one per prefill rank, each recorded as its own transfer.
    records = [json.loads(line.split("lynx transfer ", 1)[1])
               for line in decode_log.splitlines() if "lynx transfer {" in line]
    rooms = {}
    for record in records:
        rooms.setdefault(record["room"], []).append(record)
    assert len(rooms) >= len(PROMPTS) and all(len(parts) == TP for parts in rooms.values()), rooms
