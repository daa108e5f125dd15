"""End to end through real SGLang over RDMA verbs: inside the soft-RoCE guest (scripts/rdma_vm.sh),
a prefill + decode + router with `--disaggregation-transfer-backend lynx --lynx-transport verbs`
on rxe0 must produce the same greedy tokens as a single SGLang server started in the same guest.

The reference is computed in the guest, not taken from the host stage: the guest's emulated CPU
(QEMU TCG, `-cpu max`) may pick other torch kernels than the host, and greedy decoding of a small
model can flip on a near tie. Everything here is slow (SGLang servers under CPU emulation take
minutes to start), so it is one short request. Outside the guest it skips: the host has no RDMA.
"""

from __future__ import annotations

import os

import pytest

from lynx_tools.client import generate
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.rdma_vm, pytest.mark.sglang, pytest.mark.slow]

DEVICE = os.environ.get("LYNX_RDMA_DEVICE") if os.environ.get("LYNX_RDMA_VM") else None
PROMPT = "The capital of France is"
NEW_TOKENS = 8
# Measured in the guest on an idle 2-core host: one SGLang server takes several minutes to start.
STARTUP_TIMEOUT_S = 1500.0


@pytest.fixture(scope="module")
def guest_model(sglang_model):
    if DEVICE is None:
        pytest.skip("needs the soft-RoCE guest (scripts/rdma_vm.sh sets LYNX_RDMA_VM and "
                    "LYNX_RDMA_DEVICE); this host has no RDMA device")
    return sglang_model


@pytest.mark.timeout(3 * STARTUP_TIMEOUT_S)
def test_verbs_pd_matches_single_server(guest_model, start_cluster):
    single = start_cluster(ClusterSpec(guest_model, ClusterMode.SINGLE,
                                       startup_timeout_s=STARTUP_TIMEOUT_S))
    want = generate(single.url, text=PROMPT, max_new_tokens=NEW_TOKENS, timeout_s=600).output_ids
    single.stop()  # the guest has room for one cluster at a time
    assert len(want) == NEW_TOKENS

    pd = start_cluster(ClusterSpec(
        guest_model, ClusterMode.PD, "lynx", startup_timeout_s=STARTUP_TIMEOUT_S,
        server_args=("--lynx-transport", "verbs", "--lynx-ib-device", DEVICE,
                     "--lynx-target", "exact", "--lynx-transfer-timeout-s", "600",
                     "--lynx-connect-timeout-s", "600"),
    ))
    got = generate(pd.url, text=PROMPT, max_new_tokens=NEW_TOKENS, timeout_s=900).output_ids
    assert got == want
    decode_log = pd.log_path("decode").read_text(errors="replace")
    assert "transport session from prefill rank" in decode_log
    assert "transport='verbs'" in decode_log  # the KV manager's config line
