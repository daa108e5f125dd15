"""`lynx-sglang doctor`: what this machine has for running Lynx inside SGLang, and what is missing.

Each check is one line: OK, WARN (works, but not as it should for serving) or FAIL (Lynx cannot run
this way), with what was found and what to do. Checks: the installed SGLang against the supported
releases (by name; with `--hooks` by the fingerprints the servers compare, and each hook's target
and signature), the plugin's entry point (how SGLang finds Lynx), the C codec, pyverbs and the RDMA devices
it sees, whether GPUDirect RDMA is possible on the verbs device (`--ib-device`, else the first one;
Lynx stages in host memory either way), the transport secret (its file's mode too, as the servers
check it), the TLS files (`--tls-cert/--tls-key/--tls-ca`: they load, chain to the CA, and how long
they stay valid), and, with `--model`, the staging memory one request of `--context-tokens` needs
against `--staging-mib`. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lynx_transport.gpu_direct import Probes


class Verdict(Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    detail: str


def check_sglang() -> Check:
    """Cheap (no SGLang import): the installed version against the supported releases' names.
    The servers decide by fingerprints (`--hooks` checks them here)."""
    from lynx_sglang.upstream.fingerprints import installed_version, known_releases

    found, supported = installed_version(), list(known_releases())
    if found == "not installed":
        return Check("sglang", Verdict.FAIL, "not installed: pip install 'lynx-sglang[sglang]'")
    if found in supported:
        return Check("sglang", Verdict.OK, found)
    return Check("sglang", Verdict.WARN, (
        f"{found}, not one of the supported releases ({', '.join(supported)}) by name; the "
        "servers compare its fingerprints at start-up and refuse it if they differ "
        "(`lynx-sglang doctor --hooks` checks now)"))


def check_hooks() -> list[Check]:
    """Imports SGLang (tens of seconds): the release its fingerprints match, and each hook Lynx
    registers: does its target resolve, with the signature of a supported release."""
    from lynx_sglang.upstream import cpu_compat, fingerprints, hook_check

    if not cpu_compat.cuda_device_present():
        # as the servers run on a CPU box (SGLang's CPU engine, its CUDA-only imports stubbed)
        os.environ.setdefault(cpu_compat.CPU_ENGINE_ENV, "1")
        cpu_compat.activate()
    found = fingerprints.installed()
    identity = fingerprints.identify(found)
    if identity.known:
        release = Check("release", Verdict.OK, f"SGLang {identity.installed} has the fingerprints "
                                               f"of supported release {identity.release}")
    else:
        missing = bool(identity.missing)
        release = Check("release", Verdict.FAIL if missing else Verdict.WARN, (
            f"SGLang {identity.installed} is no supported release: {len(identity.changed)} "
            f"differ from {identity.nearest}'s fingerprints (the servers refuse it"
            + (" even with --lynx-allow-unknown-sglang: a function is missing)"
               if missing else " unless --lynx-allow-unknown-sglang)") + ":\n"
            + fingerprints.describe_changes(identity, found, limit=len(identity.changed))))
    hooks = [Check(f"hook {s.hook.name}", Verdict.OK if s.ok else Verdict.FAIL,
                   f"{s.hook.kind} {s.hook.target}" + ("" if s.ok else (
                       ": missing" if not s.resolves else f": signature {s.signature}")))
             for s in hook_check.statuses(found)]
    return [release, *hooks]


def check_plugin() -> Check:
    points = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins")
              if e.name == "lynx"]
    if not points:
        return Check("plugin", Verdict.FAIL, "no `lynx` entry point in sglang.srt.plugins: "
                     "install this package into SGLang's environment (pip install .)")
    return Check("plugin", Verdict.OK, f"entry point lynx = {points[0].value}")


def check_codec() -> Check:
    from lynx_kernels import ops_cpu

    if ops_cpu.available():
        return Check("C codec", Verdict.OK, f"built ({ops_cpu.isa()})")
    return Check("C codec", Verdict.WARN, f"{ops_cpu.unavailable_reason()}: CPU KV pools use the "
                 "torch reference, ~50x slower (install gcc and reinstall)")


def rdma_devices() -> list[str]:
    """The RDMA devices the kernel exposes (what pyverbs would open)."""
    root = Path("/sys/class/infiniband")
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def check_rdma() -> Check:
    try:
        import pyverbs  # noqa: F401
    except ImportError as exc:
        return Check("rdma", Verdict.WARN, f"pyverbs not importable ({exc}): --lynx-transport tcp "
                     "only (Debian/Ubuntu: apt install python3-pyverbs; a venv needs "
                     "--system-site-packages)")
    devices = rdma_devices()
    if not devices:
        return Check("rdma", Verdict.WARN, "pyverbs importable, no RDMA device: --lynx-transport "
                     "tcp only (soft-RoCE for a test: rdma link add rxe0 type rxe netdev IFACE)")
    return Check("rdma", Verdict.OK, f"devices {', '.join(devices)}")


def check_gpu_direct(device: str | None, probes: Probes | None = None) -> Check:
    """Whether the NIC could read GPU memory itself on `device` (`lynx_transport.gpu_direct`).
    OK either way: the verbs transport stages in host memory, which works on every machine."""
    from lynx_transport import gpu_direct

    found = gpu_direct.detect(device, probes)
    return Check("gpudirect", Verdict.OK, found.summary())


def check_secret(secret_file: str | None, insecure: bool = False) -> Check:
    """The secret as the servers would load it: a secret file that is a symbolic link or that
    others than its owner may access fails, or is a warning with `insecure`."""
    from lynx_sglang.config import SECRET_ENV, LynxConfig, flag_name
    from lynx_sglang.errors import LynxConfigError
    from lynx_sglang.secret_file import read_secret_file

    try:
        secret = LynxConfig(secret_file=secret_file, insecure=insecure).load_secret()
    except LynxConfigError as exc:
        return Check("secret", Verdict.FAIL, str(exc))
    if secret is None:
        return Check("secret", Verdict.WARN, f"none (--lynx-secret-file or ${SECRET_ENV}): the "
                     "servers will only listen on loopback unless --lynx-insecure")
    if not secret_file:
        return Check("secret", Verdict.OK, f"{len(secret)} bytes from ${SECRET_ENV}")
    read = read_secret_file(secret_file, flag_name("secret_file"))
    found = f"{len(secret)} bytes from {secret_file}" + (" (hex digits)" if read.hex else "")
    if read.unsafe:
        return Check("secret", Verdict.WARN, f"{found}, accepted by --lynx-insecure, but "
                     f"{read.unsafe}")
    return Check("secret", Verdict.OK, found)


def check_tls(cert: str | None, key: str | None, ca: str | None) -> Check:
    """The TLS files a server would get: they load as its contexts would, the certificate
    chains to the CA, and its expiry (WARN within 30 days). Without any: WARN (KV in clear)."""
    import datetime

    from lynx_sglang.config import LynxConfig
    from lynx_sglang.errors import LynxConfigError

    if not (cert or key or ca):
        return Check("tls", Verdict.WARN, "none: the tcp transport's KV bytes cross the network "
                     "in clear (--lynx-tls-cert/-key/-ca; `lynx-sglang tls-certs` makes them), "
                     "or run the PD links over WireGuard/IPsec")
    try:
        tls = LynxConfig(tls_cert=cert, tls_key=key, tls_ca=ca).tls_config()
    except LynxConfigError as exc:
        return Check("tls", Verdict.FAIL, str(exc))
    from cryptography import x509

    failure = _loopback_handshake(tls)
    if failure:
        return Check("tls", Verdict.FAIL, f"a TLS handshake of {tls.cert_file} with itself, "
                     f"checked against {tls.ca_file} as peers check it, failed: {failure}")
    leaf = x509.load_pem_x509_certificate(Path(tls.cert_file).read_bytes())
    utc = datetime.timezone.utc
    expires = getattr(leaf, "not_valid_after_utc", None) or leaf.not_valid_after.replace(
        tzinfo=utc)  # cryptography < 42 has only the naive one
    left = expires - datetime.datetime.now(utc)
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        hosts = ", ".join(str(n.value) for n in names)
    except x509.ExtensionNotFound:
        hosts = "(no subject alternative names: a prefill that checks host names refuses it)"
    what = f"certificate {tls.cert_file} for {hosts}, valid {left.days} more days, CA {tls.ca_file}"
    if left.days < 0:
        return Check("tls", Verdict.FAIL, f"{what}: expired")
    return Check("tls", Verdict.WARN if left.days < 30 else Verdict.OK, what)


def _loopback_handshake(tls) -> str:
    """Handshake `tls`'s server and client contexts with each other over a socket pair (host
    names not checked: the pair has none); "" if both sides accepted, else why not."""
    import socket
    import ssl
    import threading

    server_ctx = tls.server_context()
    client_ctx = tls.client_context()
    client_ctx.check_hostname = False
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    errors: list[str] = []

    def serve():
        try:
            with server_ctx.wrap_socket(a, server_side=True) as s:
                s.recv(1)
        except (ssl.SSLError, OSError) as exc:
            errors.append(f"the accepting side: {exc}")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with client_ctx.wrap_socket(b) as c:
            c.sendall(b"x")
    except (ssl.SSLError, OSError) as exc:
        errors.append(f"the dialing side: {exc}")
    t.join(10)
    a.close()
    b.close()
    return "; ".join(errors)


def check_staging(model: str, context_tokens: int, staging_mib: int) -> Check:
    from lynx_kernels import CodecSpec, model_shape
    from lynx_sglang.backend.plan import StreamPlan
    from lynx_sglang.backend.staging import ALIGN
    from lynx_sglang.backend.window import choose
    from lynx_sglang.errors import StagingFullError

    try:
        shape = model_shape(model)
    except (ValueError, OSError) as exc:
        return Check("staging", Verdict.FAIL, f"--model {model}: {exc}")
    plan = StreamPlan.build(CodecSpec(), shape, context_tokens, 256)
    need = plan.staging_bytes
    have = staging_mib << 20
    what = (f"{shape.name or model}: one {context_tokens}-token request holds {need / 2**20:,.0f} "
            f"MiB of staging; --lynx-staging-mib {staging_mib} holds {have // need} at once")
    if need > have:
        whole = f"--lynx-staging-mib {-(-need // 2**20)} would hold it whole"
        try:
            w = choose(plan, have, ALIGN)
        except StagingFullError as exc:
            return Check("staging", Verdict.FAIL, f"{what}: {exc}; {whole}")
        return Check("staging", Verdict.WARN, (
            f"{what}: it is sent in segments of {w.layers_per_segment} layers through "
            f"{w.count} window(s), without speculation; {whole}"))
    return Check("staging", Verdict.OK if have // need >= 4 else Verdict.WARN, what)


def run_checks(args: argparse.Namespace) -> list[Check]:
    checks = [check_sglang(), check_plugin(), check_codec(), check_rdma(),
              check_gpu_direct(args.ib_device), check_secret(args.secret_file, args.insecure),
              check_tls(args.tls_cert, args.tls_key, args.tls_ca)]
    if args.model:
        checks.append(check_staging(args.model, args.context_tokens, args.staging_mib))
    if args.hooks:
        checks += check_hooks()
        if args.record_release:
            from lynx_sglang.upstream.fingerprints import record

            checks.append(Check("recorded", Verdict.OK, str(record())))
    return checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder / config.json, or a preset (SmolLM2-135M, "
                             "Llama-3.1-8B, ...), to size staging for")
    parser.add_argument("--context-tokens", type=int, default=8192,
                        help="prompt length to size staging for (default: %(default)s)")
    parser.add_argument("--staging-mib", type=int, default=256,
                        help="the --lynx-staging-mib you intend (default: %(default)s)")
    parser.add_argument("--ib-device", default=None,
                        help="the --lynx-ib-device you intend, for the GPUDirect line "
                             "(default: the first RDMA device)")
    parser.add_argument("--secret-file", default=None,
                        help="the --lynx-secret-file you intend (default: $LYNX_SGLANG_SECRET)")
    parser.add_argument("--insecure", action="store_true",
                        help="you intend --lynx-insecure: a secret file that is a symbolic link "
                             "or that others than its owner may access is then a warning, not a "
                             "failure")
    for what in ("cert", "key", "ca"):
        parser.add_argument(f"--tls-{what}", default=None,
                            help=f"the --lynx-tls-{what} you intend")
    parser.add_argument("--hooks", action="store_true",
                        help="also import SGLang (tens of seconds) and check it: the supported "
                             "release its fingerprints match (or what differs), and each hook "
                             "Lynx registers (does it resolve, with a known signature)")
    parser.add_argument("--record-release", action="store_true",
                        help="with --hooks: write the installed SGLang's fingerprints as a "
                             "supported release (lynx_sglang/upstream/releases/VERSION.json), "
                             "once Lynx has been ported to it and its tests pass "
                             "(docs/operators.md, \"Adding an SGLang release\")")


def run(args: argparse.Namespace) -> int:
    checks = run_checks(args)
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.verdict.value:<5} {c.name:<{width}}  {c.detail}")
    return 1 if any(c.verdict is Verdict.FAIL for c in checks) else 0
