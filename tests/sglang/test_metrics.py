"""Lynx's Prometheus metrics (lynx_sglang.metrics) in prometheus_client's multiprocess mode, the
mode SGLang's `/metrics` uses with --enable-metrics. Each case runs in a fresh interpreter: the
mode is chosen when prometheus_client is imported."""

from __future__ import annotations

import re
import subprocess
import sys

RECORD_AND_EXPORT = """
from lynx_sglang import metrics
from lynx_sglang.failures import FailureKind
m = metrics.Metrics("smollm2", "decode", 1)
m.record_transfer(1000, 3000, 0.25, 1.5, 3)
m.record_failure(FailureKind.TIMEOUT)
m.record_failure(FailureKind.SETTINGS_MISMATCH)
m.record_staging_used(4096)
m.record_verification(10, 7, "verified")
m.record_verification(0, 0, "not_speculable")
m.record_verify_time(0.2)
m.record_stage("encode", 0.5)
m.record_tracked({"decode_rooms": 2})
m.record_listener({"listener_restarts": 1, "preambles_evicted": 40})
print("ENABLED", metrics.enabled())
import os
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    print(generate_latest(registry).decode())
"""


def _run(env_dir: str | None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if env_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = env_dir
    out = subprocess.run([sys.executable, "-c", RECORD_AND_EXPORT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _value(text: str, name: str, **labels: str) -> float:
    """The sample `name` whose labels are exactly this process's plus `labels` (the multiprocess
    exporter orders labels by name)."""
    want = {"model_name": "smollm2", "role": "decode", "tp_rank": "1", **labels}
    found = []
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', head[len(name):]))
            if got == want:
                found.append(float(value))
    (only,) = found
    return only


def test_metrics_reach_the_multiprocess_exporter(tmp_path):
    text = _run(str(tmp_path))
    assert "ENABLED True" in text
    assert _value(text, "lynx_stream_bytes_total", stream="anchor") == 1000
    assert _value(text, "lynx_stream_bytes_total", stream="residual") == 3000
    assert _value(text, "lynx_anchor_bits_requests_total", bits="3") == 1
    assert _value(text, "lynx_spec_tokens_total", fate="speculated") == 10
    assert _value(text, "lynx_spec_tokens_total", fate="accepted") == 7
    assert _value(text, "lynx_spec_tokens_total", fate="rolled_back") == 3
    assert _value(text, "lynx_spec_requests_total", outcome="verified") == 1
    assert _value(text, "lynx_spec_requests_total", outcome="not_speculable") == 1
    assert _value(text, "lynx_anchor_to_residual_seconds_count") == 1
    assert _value(text, "lynx_spec_verify_seconds_sum") == 0.2
    assert _value(text, "lynx_request_failures_total", kind="timeout") == 1
    assert _value(text, "lynx_request_failures_total", kind="settings_mismatch") == 1
    assert _value(text, "lynx_staging_used_bytes") == 4096
    assert _value(text, "lynx_stage_seconds_sum", stage="encode") == 0.5
    assert _value(text, "lynx_tracked_requests", map="decode_rooms") == 2
    assert _value(text, "lynx_tcp_listener_events", event="listener_restarts") == 1
    assert _value(text, "lynx_tcp_listener_events", event="preambles_evicted") == 40


def test_metrics_are_a_no_op_without_enable_metrics():
    assert "ENABLED False" in _run(None)
