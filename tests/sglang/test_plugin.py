"""The SGLang plugin against the installed SGLang, whichever supported release it is (another
release's wheel runs it through PYTHONPATH: docs/operators.md): every hook target exists, the
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


def test_the_installed_sglang_has_the_fingerprints_of_a_supported_release(probe):
    """Which SGLang functions Lynx hooks, subclasses or copies changed, if any (the release file
    is `lynx-sglang doctor --hooks --record-release`'s: docs/operators.md, adding a release)."""
    from lynx_sglang.upstream.fingerprints import known_releases

    assert probe["changed"] == [] and probe["release"] in known_releases(), probe["changed"]
    assert probe["hooks_not_ok"] == []


def test_the_table_lists_every_method_the_lynx_classes_override(probe):
    """Each Lynx class derives from a class of the table (the sender and receiver from the one
    the release adapter picked) and overrides exactly the methods listed for it."""
    from lynx_sglang.upstream.hook_table import SUBCLASSED

    assert probe["overrides"] == {base: sorted(SUBCLASSED.get(base, ())) for base in probe["overrides"]}
    assert len(probe["overrides"]) == 4
    assert set(probe["adapter_bases"]) <= set(probe["overrides"]), probe["adapter_bases"]


def test_every_hook_is_in_place_and_a_hook_sglang_skipped_stops_the_start(probe):
    """SGLang's registry only logs a hook it does not apply (here: registered on a target it had
    patched already); Lynx's start-up check names it and refuses to serve half-hooked."""
    assert probe["verified"] is None
    half = probe["half_hooked"]
    assert half is not None and "UnsupportedSGLangError" in half and "refusing to serve" in half
    assert "sglang.srt.server_args.ServerArgs.add_cli_args (AFTER late_adapter): registered " \
           "but not applied" in half


def test_a_hook_target_with_a_signature_no_supported_release_has_is_refused(probe):
    """The start-up check compares each applied hook's target with the signatures the supported
    releases record (so an unknown release let in by --lynx-allow-unknown-sglang still cannot
    hand an adapter arguments it would misread)."""
    changed = probe["changed_signature"]
    assert changed is not None and "UnsupportedSGLangError" in changed, changed
    assert ("sglang.srt.server_args.ServerArgs.add_cli_args (AFTER _add_cli_args_after): "
            "signature (parser: 'argparse.ArgumentParser')" in changed), changed
    assert "which no supported release has ((self, moved))" in changed, changed


def test_doctor_hooks_prints_the_release_and_each_hook():
    proc = subprocess.run([sys.executable, "-m", "lynx_tools.cli", "doctor", "--hooks"],
                          capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("OK") and "release" in ln and "supported release" in ln
               for ln in lines), proc.stdout[-2000:]
    from lynx_sglang.upstream.hook_table import HOOKS

    for hook in HOOKS:
        assert any(ln.startswith("OK") and f"hook {hook.name} " in ln and hook.target in ln
                   for ln in lines), (hook.name, proc.stdout[-3000:])
