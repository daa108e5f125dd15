"""End to end through real SGLang: prefill + decode + router with
`--disaggregation-transfer-backend lynx`, greedy decoding.

One cluster for the module (target exact; over a 1 Gbit/s shaped link between two network
namespaces when run as root): outputs must be token-identical to a single server.
The prefill holds each request's Residual back for a few seconds after its Anchor (fault-injection
knob of the Lynx sender), which lets the last test kill the prefill between Anchor and Residual:
the client must get an error, not a hang; the decode must free the request's KV slots and serve
the next request once a prefill is back.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from layer_streaming import ALWAYS_STREAM

from lynx_sglang.names import FAULT_RESIDUAL_DELAY_ENV, FAULT_RESIDUAL_HOLD_LOG
from lynx_tools.client import GenerateError, generate
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

RESIDUAL_DELAY_S = 4.0
TRANSFER_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def lynx_cluster(sglang_model, start_cluster, pd_link):
    return start_cluster(ClusterSpec(
        sglang_model, ClusterMode.PD, "lynx", link=pd_link,
        server_args=("--lynx-target", "exact",
                     "--lynx-transfer-timeout-s", str(TRANSFER_TIMEOUT_S), *ALWAYS_STREAM),
        # SGLang's decode forgets a dead prefill's bootstrap info after two missed heartbeats
        # (5 s apart); a prefill restarted faster than that used to leave it stale. Never
        # letting the heartbeat decide makes the restart below test Lynx's own handling.
        extra_env={FAULT_RESIDUAL_DELAY_ENV: str(RESIDUAL_DELAY_S),
                   "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1000",
                   # every process of each server logs each module it imports (stderr, in the
                   # server's log): what test_servers_import_no_tool reads
                   "PYTHONPROFILEIMPORTTIME": "1"},
    ))


def test_lynx_exact_matches_single_server(lynx_cluster, reference_outputs, prompts,
                                          max_new_tokens):
    for prompt in prompts:
        got = generate(lynx_cluster.url, text=prompt, max_new_tokens=max_new_tokens)
        assert len(got.output_ids) == max_new_tokens
        assert got.output_ids == reference_outputs[prompt], prompt[:60]
    log = lynx_cluster.log_path("decode").read_text(errors="replace")
    assert "lynx KV manager (decode)" in log
    assert "transport session from prefill rank" in log
    # Layer streaming (every room: ALWAYS_STREAM): the Anchor went out layer by layer during the forward,
    # every layer opened by SGLang's own KV writes before the forward ended.
    prefill_log = lynx_cluster.log_path("prefill").read_text(errors="replace")
    opened = re.search(r"first streamed forward opened (\d+) of (\d+) layers", prefill_log)
    assert opened is not None and opened[1] == opened[2], prefill_log[-2000:]


def test_servers_import_no_tool(lynx_cluster):
    """The runtime SGLang loads stays apart from the tools: no process of a serving prefill or
    decode imported `lynx_tools` (tests/test_layout.py checks the source; this, what ran)."""
    for role in ("prefill", "decode"):
        imported = re.findall(r"^import time:.*\|\s*(\S+)$",
                              lynx_cluster.log_path(role).read_text(errors="replace"), re.M)
        # the log holds the servers' imports: the check can see a Lynx module when there is one
        assert "lynx_sglang.backend.manager" in imported, role
        tools = sorted({m for m in imported if m.split(".")[0] == "lynx_tools"})
        assert not tools, f"the {role} server imported {tools}"


def test_prefill_killed_between_anchor_and_residual(lynx_cluster, reference_outputs, prompts,
                                                    max_new_tokens):
    before = lynx_cluster.decode_used_tokens()
    prefill_log = lynx_cluster.log_path("prefill")
    marks = prefill_log.read_text(errors="replace").count(FAULT_RESIDUAL_HOLD_LOG)
    result: dict = {}

    def client():
        t0 = time.monotonic()
        try:
            result["gen"] = generate(lynx_cluster.url, text=prompts[-1],
                                     max_new_tokens=max_new_tokens, timeout_s=120)
        except GenerateError as exc:
            result["error"] = exc
        result["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 120
    while prefill_log.read_text(errors="replace").count(FAULT_RESIDUAL_HOLD_LOG) <= marks:
        assert time.monotonic() < deadline, "the prefill never finished the Anchor"
        time.sleep(0.1)
    lynx_cluster.kill("prefill")
    t.join(timeout=TRANSFER_TIMEOUT_S + 60)
    assert not t.is_alive(), "the client hung after the prefill died"
    assert "error" in result, f"expected an error, got {result.get('gen')}"
    assert result["elapsed"] < TRANSFER_TIMEOUT_S + 30
    # The decode frees the request's KV slots.
    deadline = time.monotonic() + 30
    while lynx_cluster.decode_used_tokens() != before:
        assert time.monotonic() < deadline, "decode KV usage did not return to its level"
        time.sleep(0.5)
    assert lynx_cluster.proc("decode").poll() is None, "the decode server died"
    # With a prefill back, the same decode serves the next request correctly.
    lynx_cluster.restart("prefill")
    # The decode dropped the dead rank's cached bootstrap info when its Residual failed
    # (peer_died), so the first request reaches the new prefill (on a new rank port).
    got = generate(lynx_cluster.url, text=prompts[0], max_new_tokens=max_new_tokens, timeout_s=120)
    assert got.output_ids == reference_outputs[prompts[0]]
    assert "dropped its cached bootstrap info" in lynx_cluster.log_path("decode").read_text(
        errors="replace")


def test_bad_client_input_is_a_4xx_and_nothing_dies(lynx_cluster, reference_outputs, prompts,
                                                    max_new_tokens):
    """An empty prompt (no KV to transfer) used to stop the decode scheduler and leave every later
    request with HTTP 500; with Lynx an empty text is refused before it reaches a scheduler.
    Empty `input_ids` SGLang refuses itself, but sglang-router's mini load balancer fails on them
    (IndexError in `_get_request_batch_size`: its 500, not ours); what matters is that the servers
    keep serving."""
    with pytest.raises(GenerateError, match=r"HTTP 400.*prompt is empty"):
        generate(lynx_cluster.url, text="", max_new_tokens=4)
    with pytest.raises(GenerateError, match=r"HTTP [45]\d\d"):
        generate(lynx_cluster.url, input_ids=[], max_new_tokens=4)
    got = generate(lynx_cluster.url, text=prompts[0], max_new_tokens=max_new_tokens)
    assert got.output_ids == reference_outputs[prompts[0]]
