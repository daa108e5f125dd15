"""Lynx on an MLA model with tensor parallelism, through real PD on this CPU (SGLang's CPU TP over
gloo): the tiny random-weight DeepSeek-V2 of tiny_deepseek.py with a TP 2 prefill and a TP 1
decode, and a TP 1 prefill with a TP 2 decode.

Every TP rank of an MLA model holds the whole latent (nothing to slice by head), so SGLang has
each decode rank read it from one prefill rank and sends the others dummy requests: with a TP 2
prefill the decode's one rank gets its room from one of them, with a TP 2 decode each decode rank
gets the whole latent from the one prefill rank. Lynx follows that pairing (`backend.heads` is
for MHA pools only). The reference is SGLang's own `mooncake_tcp` on the same sizes: random
weights are initialised per TP shard, so no single server computes what a mixed-size pair
does, but an exact Lynx transfer leaves the decode the KV Mooncake's raw bytes do, so the same
greedy tokens.

SGLang's CPU engine binds each rank's OpenMP threads to cores: with more ranks than NUMA nodes it
refuses to start unless SGLANG_CPU_OMP_THREADS_BIND names one core list per rank. Skips where the
box has fewer than 2 cores.
"""

from __future__ import annotations

import os
import re

import pytest
from tiny_deepseek import DUMMY, MAX_NEW_TOKENS, PROMPTS, write_model

from lynx_tools.client import generate
from lynx_tools.cluster.local import Cluster
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

THREADS_BIND = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


@pytest.fixture(scope="module")
def mla_model(sglang_model, tmp_path_factory) -> str:
    return write_model(tmp_path_factory.mktemp("tiny-deepseek-v2"), sglang_model)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_mla_at_unequal_tp_is_token_identical_to_mooncake(mla_model, prefill_tp, decode_tp,
                                                          tmp_path_factory):
    if (os.cpu_count() or 1) < 2:
        pytest.skip(f"TP 2 on CPU binds one core per rank: this box has {os.cpu_count()}")
    answers, logs = {}, {}
    for backend in ("mooncake_tcp", "lynx"):
        spec = ClusterSpec(
            mla_model, ClusterMode.PD, backend,
            run_dir=tmp_path_factory.mktemp(f"mla-p{prefill_tp}d{decode_tp}-{backend}"),
            server_args=DUMMY + (("--lynx-target", "exact") if backend == "lynx" else ()),
            role_args={"prefill": ("--tp", str(prefill_tp)), "decode": ("--tp", str(decode_tp))},
            extra_env=THREADS_BIND, startup_timeout_s=600.0)
        with Cluster(spec) as c:  # one cluster at a time: two cores
            answers[backend] = [generate(c.url, text=p, max_new_tokens=MAX_NEW_TOKENS,
                                         timeout_s=300, rid=f"mla-tp-{backend}-{i}").output_ids
                                for i, p in enumerate(PROMPTS)]
            if backend == "lynx":
                logs = {role: c.log_path(role).read_text(errors="replace")
                        for role in ("prefill", "decode")}
    for prompt, want, have in zip(PROMPTS, answers["mooncake_tcp"], answers["lynx"], strict=True):
        assert len(have) == MAX_NEW_TOKENS
        assert have == want, prompt[:60]
    # Each decode rank had one transport session, from the prefill rank SGLang paired it with
    # (its log lines carry a TP tag only under TP > 1).
    sessions = re.findall(r"(?:TP(\d)\] |\] )lynx: transport session from prefill rank (\S+)",
                          logs["decode"])
    assert sorted(rank or "0" for rank, _ in sessions) == [str(r) for r in range(decode_tp)], \
        sessions
