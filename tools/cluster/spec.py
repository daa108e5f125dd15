"""What a local SGLang cluster is made of: its mode, its spec (`ClusterSpec`, checked on
construction) and the SGLang server command line and environment a spec gives, with the free ports
it listens on. No process is started here: `lynx_tools.cluster.local` starts them; the benchmarks, the
fault matrix and the tests build their specs with this module.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from lynx_sglang.errors import LynxError

HOST = "127.0.0.1"
TRANSFER_BACKENDS = ("lynx", "mooncake_tcp")


class ClusterMode(str, Enum):
    PD = "pd"
    SINGLE = "single"


class ClusterError(LynxError):
    pass


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. `server_args` are appended to every SGLang server's command line (e.g. the
    `--lynx-*` flags); `transfer_backend` is ignored in single mode."""

    model_path: str
    mode: ClusterMode = ClusterMode.PD
    transfer_backend: str = "lynx"
    run_dir: Path | None = None
    server_args: tuple[str, ...] = ()
    max_total_tokens: int = 8192
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # PD only: put prefill and decode in two network namespaces joined by a link shaped to this
    # rate (e.g. "1gbit"), with this qdisc (see lynx_tools.cluster.netns); None = loopback.
    link: str | None = None
    link_qdisc: str = "prio"
    # PD only: prefill servers behind the router (each its own bootstrap port), one decode.
    prefills: int = 1
    # PD only: flags for one role's servers ("prefill", "decode") after `server_args`, e.g.
    # {"decode": ("--tp", "2")} for a prefill and a decode of different TP sizes.
    role_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Lynx PD only: the tcp transport's data connections in TLS, with a CA and a node certificate
    # made for this cluster in the run dir (unless the server flags name --lynx-tls-cert).
    tls: bool = False
    # SGLang's overlap scheduler (its default) on every server; off unless asked, so that most
    # tests compare scheduling-independent runs (tests/sglang/test_pd_lynx_overlap.py runs it).
    # The tools (demo, bench-ttft, load) ask for it unless given --disable-overlap-schedule.
    overlap_schedule: bool = False
    # PD only: the CPUs each role's servers run on ("prefill", "decode"; os.sched_setaffinity,
    # inherited by their schedulers), e.g. {"prefill": (0,), "decode": (1,)}. On a small box it
    # keeps one role's work (the prefill's encode and next forward) off the other's cores, as
    # separate machines would; the router and the clients stay unpinned. Empty: no pinning.
    role_cpus: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.link and self.mode is not ClusterMode.PD:
            raise ClusterError("--link needs the PD mode (it separates prefill from decode)")
        if self.prefills < 1 or (self.prefills > 1 and self.mode is not ClusterMode.PD):
            raise ClusterError("prefills: at least 1, and more than 1 only in PD mode")
        if self.prefills > 1 and self.link:
            raise ClusterError("a shaped link joins one prefill to the decode; use prefills=1")
        if self.tls and (self.mode is not ClusterMode.PD or self.transfer_backend != "lynx"):
            raise ClusterError("--tls is the Lynx transport's: it needs --mode pd and "
                               "--transfer-backend lynx")
        if self.role_cpus and self.mode is not ClusterMode.PD:
            raise ClusterError("role_cpus pins the PD roles: it needs the PD mode")
        usable = os.sched_getaffinity(0)
        for role, cpus in self.role_cpus.items():
            if role not in ("prefill", "decode"):
                raise ClusterError(f"role_cpus: unknown role {role!r} (prefill, decode)")
            if not cpus or not set(cpus) <= usable:
                raise ClusterError(f"role_cpus: {role} on CPUs {sorted(cpus)}, but this "
                                   f"process may use only {sorted(usable)}")
        if self.transfer_backend not in TRANSFER_BACKENDS:
            raise ClusterError(
                f"transfer backend must be one of {TRANSFER_BACKENDS}, got {self.transfer_backend!r}"
            )


def sglang_pd_timeouts_env(seconds: float) -> dict[str, str]:
    """Environment for SGLang's PD bootstrap and waiting timeouts (default 300 s each): a room
    that waits longer for its prefill fails. For the tools' clusters that queue more work, or run
    slower (the soft-RoCE guest), than those defaults allow."""
    return {name: str(int(seconds)) for name in (
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cpu_only() -> bool:
    from lynx_sglang.upstream import cpu_compat

    return not cpu_compat.cuda_device_present()


def server_command(spec: ClusterSpec, port: int, role: str | None,
                   bootstrap_port: int | None, host: str = HOST) -> list[str]:
    """SGLang server command line for role None (single), "prefill" or "decode"."""
    cmd = [
        sys.executable, "-m", "lynx_sglang.serve",
        "--model-path", spec.model_path,
        "--host", host, "--port", str(port),
        "--dtype", "float32",
        "--max-total-tokens", str(spec.max_total_tokens),
        "--skip-server-warmup",
        # Idle schedulers otherwise busy-poll a core each.
        "--sleep-on-idle",
    ]
    if not spec.overlap_schedule:
        # Deterministic scheduling: greedy outputs are compared token for token.
        cmd.append("--disable-overlap-schedule")
    if cpu_only():
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
    if role is not None:
        cmd += ["--disaggregation-mode", role,
                "--disaggregation-transfer-backend", spec.transfer_backend,
                "--disaggregation-bootstrap-port", str(bootstrap_port)]
    return cmd + list(spec.server_args)


def split_cpus() -> dict[str, tuple[int, ...]]:
    """The CPUs this process may use, split in halves: the first for the prefill, the rest for
    the decode (`ClusterSpec.role_cpus`). ClusterError on a one-CPU box."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ClusterError("pinning prefill and decode apart needs at least 2 CPUs")
    half = len(cpus) // 2
    return {"prefill": tuple(cpus[:half]), "decode": tuple(cpus[half:])}
