"""Run in a subprocess by test_plugin.py (SGLang imports need the CPU engine selected and would
leak global state into the test process). Prints one JSON object with what it observed."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pkgutil
import sys
import tempfile

os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
from lynx_sglang.upstream import cpu_compat

cpu_compat.activate()
out: dict = {}

from sglang.srt.plugins import load_plugins  # noqa: E402

from lynx_sglang.upstream import fingerprints, hook_check, hook_table  # noqa: E402

load_plugins()
missing = []
for hook in hook_table.HOOKS:
    try:
        pkgutil.resolve_name(hook.target)
    except (ImportError, AttributeError) as exc:
        missing.append(f"{hook.target}: {exc}")
out["missing_targets"] = missing

from sglang.srt.server_args import prepare_server_args  # noqa: E402

model = sys.argv[1]
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    prepare_server_args(["--help"])
out["help_has_lynx_flags"] = all(
    f in help_text.getvalue() for f in ("--lynx-anchor-bits", "--lynx-target", "--lynx-transport"))
out["help_lists_backend"] = "lynx" in help_text.getvalue()

base = ["--model-path", model, "--disaggregation-mode", "decode"]
os.environ.pop("LYNX_SGLANG_CONFIG", None)
prepare_server_args([*base, "--disaggregation-transfer-backend", "mooncake"])
out["config_without_lynx"] = os.environ.get("LYNX_SGLANG_CONFIG")

prepare_server_args([*base, "--disaggregation-transfer-backend", "lynx", "--lynx-target", "exact",
                     "--lynx-anchor-bits", "5", "--lynx-insecure"])
out["config"] = json.loads(os.environ["LYNX_SGLANG_CONFIG"])

from sglang.srt.disaggregation import utils as disagg_utils  # noqa: E402

backend = disagg_utils.TransferBackend("lynx")
classes = {t.name: getattr(disagg_utils.get_kv_class(backend, t), "__qualname__", None)
           for t in disagg_utils.KVClassType}
out["classes"] = classes
out["mooncake_manager"] = disagg_utils.get_kv_class(
    disagg_utils.TransferBackend.MOONCAKE, disagg_utils.KVClassType.MANAGER).__qualname__


def error_of(argv):
    try:
        prepare_server_args(argv)
    except BaseException as exc:  # argparse exits with SystemExit
        return f"{type(exc).__name__}: {exc}"
    return None


out["refused_pp"] = error_of([*base, "--disaggregation-transfer-backend", "lynx",
                              "--pp-size", "2"])
from sglang.srt.utils.network import get_local_ip_auto  # noqa: E402

from lynx_transport.auth import is_loopback  # noqa: E402

os.environ.pop("LYNX_SGLANG_SECRET", None)
out["local_ip_is_loopback"] = is_loopback(get_local_ip_auto())
out["refused_no_secret"] = error_of([*base, "--disaggregation-transfer-backend", "lynx"])
with tempfile.NamedTemporaryFile("wb", suffix=".key") as key:
    key.write(os.urandom(32))
    key.flush()
    out["accepted_secret_file"] = error_of([*base, "--disaggregation-transfer-backend", "lynx",
                                            "--lynx-secret-file", key.name]) is None
out["refused_bits"] = error_of([*base, "--disaggregation-transfer-backend", "lynx",
                                "--lynx-anchor-bits", "9"])

# The one room: which release the installed SGLang is by its fingerprints, every hook's status,
# and the subclasses' overrides against the table.
found = fingerprints.installed()
identity = fingerprints.identify(found)
out["release"], out["changed"] = identity.release, list(identity.changed)
out["hooks_not_ok"] = [f"{s.hook.name}: {s.signature}"
                      for s in hook_check.statuses(found) if not s.ok]
from lynx_sglang.backend.conn import (  # noqa: E402
    LynxKVBootstrapServer,
    LynxKVReceiver,
    LynxKVSender,
)
from lynx_sglang.backend.manager import LynxKVManager  # noqa: E402

out["overrides"] = {
    f"{cls.__mro__[1].__module__}.{cls.__mro__[1].__qualname__}": sorted(
        n for n, v in vars(cls).items() if callable(v) and hasattr(cls.__mro__[1], n))
    for cls in (LynxKVManager, LynxKVSender, LynxKVReceiver, LynxKVBootstrapServer)}
from lynx_sglang.upstream import adapter  # noqa: E402

out["adapter_bases"] = [f"{c.__module__}.{c.__qualname__}" for c in (
    adapter.transfer().kv_sender_base, adapter.transfer().kv_receiver_base)]
out["verified"] = None
try:
    hook_check.verify_applied()
except Exception as exc:
    out["verified"] = f"{type(exc).__name__}: {exc}"


# A hook target whose signature no supported release has (as an unknown release run with
# --lynx-allow-unknown-sglang could have): refused, the adapter would misread its arguments.
real_releases = hook_check.known_releases


def releases_with_another_signature():
    releases = real_releases()
    for prints in releases.values():
        target = hook_table.CLI_FLAGS.target
        prints[target] = dataclasses.replace(prints[target], signature="(self, moved)")
    return releases


hook_check.known_releases = releases_with_another_signature
try:
    hook_check.verify_applied()
    out["changed_signature"] = None
except Exception as exc:
    out["changed_signature"] = f"{type(exc).__name__}: {exc}"
hook_check.known_releases = real_releases


# Last (it leaves the registry half-hooked): a Lynx hook registered on a target SGLang has
# patched already is skipped by `apply_hooks`, with nothing but a log line of SGLang's own.
def late_adapter(result, *args, **kwargs):
    return result


late_adapter.__module__ = "lynx_sglang.probe"
hook_check.register(hook_table.CLI_FLAGS, late_adapter)
hook_check.apply()
try:
    hook_check.verify_applied()
    out["half_hooked"] = None
except Exception as exc:
    out["half_hooked"] = f"{type(exc).__name__}: {exc}"
print("PROBE " + json.dumps(out))
