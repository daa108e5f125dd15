"""The SGLang plugin against the installed (pinned) SGLang: every hook target exists, the
`--lynx-*` flags parse and reach the environment, `lynx` maps to the Lynx classes (and other
backends still map to SGLang's), unsupported options and bad values are refused.

SGLang is imported in a subprocess (tests/sglang/plugin_probe.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def probe(sglang_model) -> dict:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("plugin_probe.py")), sglang_model],
        capture_output=True, text=True, timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line, f"probe failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(line[len("PROBE "):])


def test_hook_targets_exist(probe):
    assert probe["missing_targets"] == []


def test_flags_in_help(probe):
    assert probe["help_has_lynx_flags"]
    assert probe["help_lists_backend"]


def test_flags_reach_the_environment_only_for_lynx(probe):
    assert probe["config_without_lynx"] is None
    assert probe["config"]["target"] == "exact"
    assert probe["config"]["anchor_bits"] == 5


def test_backend_maps_to_lynx_classes(probe):
    assert probe["classes"] == {
        "KVARGS": "KVArgs",
        "MANAGER": "LynxKVManager",
        "SENDER": "LynxKVSender",
        "RECEIVER": "LynxKVReceiver",
        "BOOTSTRAP_SERVER": "LynxKVBootstrapServer",
    }
    assert probe["mooncake_manager"] == "MooncakeKVManager"


def test_unsupported_options_are_refused(probe):
    assert "UnsupportedSGLangError" in probe["refused_pp"]
    assert "--pp-size" in probe["refused_pp"]
    assert "LynxConfigError" in probe["refused_bits"]
    assert "anchor-bits" in probe["refused_bits"]


def test_a_reachable_listener_needs_a_secret(probe):
    if probe["local_ip_is_loopback"]:
        pytest.skip("this host's SGLang address is loopback: no secret is required there")
    assert "LynxConfigError" in probe["refused_no_secret"]
    assert "--lynx-secret-file" in probe["refused_no_secret"]
    assert probe["accepted_secret_file"]
