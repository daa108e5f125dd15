"""A local SGLang cluster: prefill + decode + sglang-router (mini load balancer, PD mode), or one
plain server for reference outputs. Owns the processes it starts and their logs.

Every server runs as `python -m lynx_sglang.serve` (SGLang's launch_server with Lynx's CPU
compatibility active from interpreter start, see that module) in its own session, so a Ctrl-C at
the terminal reaches only the tool, which stops the cluster itself. `stop()` ends each whole
process tree (psutil: the process, its descendants and whatever is left in its process group):
SIGTERM, then SIGKILL to what is still alive after a deadline. `start()` waits for each server's
/health (and the router's) with a deadline and fails with the tail of the log of a process that
died or never came up. Logs: `<run_dir>/<name>.log`.

Used by `lynx-sglang up` (`run`), the tests (tests/sglang/conftest.py) and the benchmarks.
What to start is a `lynx_tools.cluster.spec.ClusterSpec`; the process-tree census is
`lynx_tools.cluster.process_tree`'s.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests

from .netns import RECEIVER_IP, SENDER_IP, Forwarder, ShapedLink
from .process_tree import Resources, process_tree, tree_fd_kinds, tree_resources, wait_exited
from .spec import (
    HOST,
    TRANSFER_BACKENDS,
    ClusterError,
    ClusterMode,
    ClusterSpec,
    cpu_only,
    free_port,
    server_command,
)

logger = logging.getLogger(__name__)

# The router binds a port chosen before the servers started; another process may take it meanwhile.
ROUTER_PORT_TRIES = 3
PORT_TAKEN = "address already in use"


@dataclass
class _Proc:
    name: str
    cmd: list[str]
    popen: subprocess.Popen
    log_path: Path
    health_url: str
    host_ip: str


class Cluster:
    """Context manager: `with Cluster(spec) as c: c.url` (router URL in PD mode). `on_wait`, if
    given, is called about once a second during start-up with the names of the processes not yet
    healthy and the seconds waited so far (progress reports)."""

    def __init__(self, spec: ClusterSpec,
                 on_wait: Callable[[list[str], float], None] | None = None):
        self.spec = spec
        self._on_wait = on_wait
        self.run_dir = Path(spec.run_dir or tempfile.mkdtemp(prefix="lynx-cluster-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._procs: list[_Proc] = []
        self._link: ShapedLink | None = None
        self._forwarders: list[Forwarder] = []
        self.url = ""
        self.prefill_url = ""
        self.prefill_urls: list[str] = []
        self.decode_url = ""

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _env(self, host_ip: str) -> dict[str, str]:
        env = dict(os.environ)
        # SGLang's KV managers (Mooncake's engine, our transport endpoint) bind this address.
        env["SGLANG_HOST_IP"] = host_ip
        env.setdefault("HF_HUB_OFFLINE", "1")
        if cpu_only():
            # OpenMP's default spin-waiting makes 2 torch threads on 2 shared cores up to ~30x
            # slower for the codec's many small ops (measured: scripts/bench_kv_path.py); the
            # servers of every backend get the same setting.
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.update(self.spec.extra_env)
        return env

    def _spawn(self, name: str, cmd: list[str], health_url: str, host_ip: str = HOST,
               cpus: tuple[int, ...] = ()) -> _Proc:
        """Start one process (on `cpus` only, if given: util-linux's taskset sets it before the
        command runs, so everything the command starts inherits it)."""
        if cpus:
            cmd = ["taskset", "--cpu-list", ",".join(map(str, cpus)), *cmd]
        log_path = self.run_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the child; closed below
        try:
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(host_ip),
                start_new_session=True,
            )
        finally:
            log.close()
        (self.run_dir / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        proc = _Proc(name, cmd, popen, log_path, health_url, host_ip)
        self._procs.append(proc)
        logger.info("started %s (pid %d), log %s", name, popen.pid, log_path)
        return proc

    def _with_secret(self, spec: ClusterSpec) -> ClusterSpec:
        """A Lynx pair authenticates its transport sessions with a shared secret: unless the
        flags name one (or opt out), generate one for this cluster (mode 0600, in the run dir)."""
        if spec.transfer_backend != "lynx" or any(
                a in spec.server_args for a in ("--lynx-secret-file", "--lynx-insecure")):
            return spec
        path = self.run_dir / "lynx-secret"
        path.write_bytes(secrets.token_bytes(32))
        path.chmod(0o600)
        return dataclasses.replace(spec, server_args=(*spec.server_args, "--lynx-secret-file",
                                                      str(path)))

    def _with_tls(self, spec: ClusterSpec) -> ClusterSpec:
        """TLS for a Lynx pair: one CA and one node certificate naming every host the cluster's
        servers may use (loopback and both namespace addresses), in the run dir."""
        if not spec.tls or "--lynx-tls-cert" in spec.server_args:
            return spec
        from .tls_certs import make_certs

        files = make_certs(self.run_dir / "tls", [HOST, SENDER_IP, RECEIVER_IP])
        return dataclasses.replace(spec, server_args=(*spec.server_args, *files.flags()))

    def start(self) -> None:
        spec = self.spec
        if spec.mode is ClusterMode.SINGLE:
            port = free_port()
            self.url = f"http://{HOST}:{port}"
            self._spawn("server", server_command(spec, port, None, None), self.url + "/health")
            self._wait_healthy(self._procs)
            return
        d_port, r_port, *rest = _distinct_free_ports(2 + 2 * spec.prefills)
        p_ports, b_ports = rest[:spec.prefills], rest[spec.prefills:]
        b_port = b_ports[0]
        spec = self._with_tls(self._with_secret(spec))
        p_host = d_host = HOST
        wrap_p = wrap_d = list
        if spec.link:
            self._link = ShapedLink().open()
            self._link.set_rate(spec.link, spec.link_qdisc)
            p_host, d_host = SENDER_IP, RECEIVER_IP
            link = self._link
            def wrap_p(cmd):
                return link.wrap(link.sender_ns, cmd)
            def wrap_d(cmd):
                return link.wrap(link.receiver_ns, cmd)
        self.prefill_urls = [self._reachable(p_host, port) for port in p_ports]
        self.prefill_url = self.prefill_urls[0]
        self.decode_url = self._reachable(d_host, d_port)
        for i, (port, bootstrap) in enumerate(zip(p_ports, b_ports, strict=True)):
            self._spawn("prefill" if i == 0 else f"prefill{i + 1}",
                        wrap_p(server_command(spec, port, "prefill", bootstrap, p_host)
                               + list(spec.role_args.get("prefill", ()))),
                        self.prefill_urls[i] + "/health", p_host,
                        spec.role_cpus.get("prefill", ()))
        decode_cmd = (server_command(spec, d_port, "decode", b_port, d_host)
                      + list(spec.role_args.get("decode", ())))
        if spec.link:
            # `ip netns exec` remounts /sys, so SGLang cannot find its memory cgroup to size the
            # decode's host KV pool for retraction backups (SGLang 0.5.21 fails at start-up even
            # with an explicit --hicache-ratio): keep those backups as CPU tensors, no pool.
            decode_cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        self._spawn("decode", wrap_d(decode_cmd),
                    self.decode_url + "/health", d_host, spec.role_cpus.get("decode", ()))
        self._wait_healthy(self._procs)
        self._start_router(wrap_d(self._router_command(
            [(f"http://{p_host}:{port}", bootstrap) for port, bootstrap in zip(p_ports, b_ports,
                                                                               strict=True)],
            f"http://{d_host}:{d_port}", d_host, r_port)), d_host, r_port)
        (self.run_dir / "cluster.json").write_text(json.dumps(
            {"router": self.url, "prefill": self.prefill_url, "prefills": self.prefill_urls,
             "decode": self.decode_url, "bootstrap_port": b_port,
             "transfer_backend": spec.transfer_backend,
             "link": spec.link, "link_qdisc": spec.link_qdisc if spec.link else None,
             "namespaces": [self._link.sender_ns, self._link.receiver_ns] if self._link else None},
            indent=1))

    @staticmethod
    def _router_command(prefills: list[tuple[str, int]], decode_url: str, host: str,
                        port: int) -> list[str]:
        """sglang-router in PD mode over (prefill URL, bootstrap port) pairs and one decode."""
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--mini-lb"]
        for url, bootstrap in prefills:
            cmd += ["--prefill", url, str(bootstrap)]
        return [*cmd, "--decode", decode_url, "--host", host, "--port", str(port)]

    def _start_router(self, cmd: list[str], host: str, port: int) -> None:
        """Start the router on `port` (the last element of `cmd` names it) and wait until it is
        healthy. Its port was chosen free when the cluster started, but the servers start first,
        and any process may bind it meanwhile (seen in CI: "address already in use"): then again
        on a new port, up to ROUTER_PORT_TRIES times."""
        for attempt in range(1, ROUTER_PORT_TRIES + 1):
            self.url = self._reachable(host, port)
            proc = self._spawn("router", cmd, self.url + "/health", host)
            try:
                self._wait_healthy([proc])
                return
            except ClusterError:
                if attempt == ROUTER_PORT_TRIES or PORT_TAKEN not in log_tail(proc.log_path).lower():
                    raise
            logger.warning("router port %d was taken before the router bound it; trying another",
                           port)
            self._procs.remove(proc)
            port = free_port()
            cmd = [*cmd[:-1], str(port)]

    def _reachable(self, host: str, port: int) -> str:
        """URL of host:port as seen from this process (a forwarder when it is in a namespace)."""
        if self._link is None:
            return f"http://{host}:{port}"
        ns = self._link.sender_ns if host == SENDER_IP else self._link.receiver_ns
        fwd = Forwarder(ns, host, port)
        self._forwarders.append(fwd)
        return fwd.url

    def _wait_healthy(self, procs: list[_Proc]) -> None:
        t_start = time.monotonic()
        deadline = t_start + self.spec.startup_timeout_s
        pending = list(procs)
        while pending:
            for proc in list(pending):
                code = proc.popen.poll()
                if code is not None:
                    raise ClusterError(
                        f"{proc.name} exited with code {code} during start-up; "
                        f"log {proc.log_path}:\n{log_tail(proc.log_path)}"
                    )
                # A slow server (SGLang's /health runs a one-token generation: seconds under
                # emulation) must be waited for, not probed again: each abandoned probe queues
                # one more generation and the server never catches up.
                if _http_ok(proc.health_url, max(1.0, min(30.0, deadline - time.monotonic()))):
                    logger.info("%s healthy", proc.name)
                    pending.remove(proc)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.name for p in pending)
                tails = "\n".join(f"--- {p.name}:\n{log_tail(p.log_path)}" for p in pending)
                raise ClusterError(
                    f"{names} not healthy after {self.spec.startup_timeout_s:.0f} s\n{tails}"
                )
            if pending and self._on_wait is not None:
                self._on_wait([p.name for p in pending], time.monotonic() - t_start)
            time.sleep(1.0)

    @property
    def link(self) -> ShapedLink | None:
        """The shaped link between prefill and decode (`spec.link`), for fault injection."""
        return self._link

    def proc(self, name: str) -> subprocess.Popen:
        for p in self._procs:
            if p.name == name:
                return p.popen
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        """The cluster's processes by name ("server"; or "prefill", "prefill2", ..., "decode",
        "router")."""
        return [p.name for p in self._procs]

    def resources(self, name: str) -> Resources:
        """Threads, fds and RSS of one process tree now (leak checks)."""
        return tree_resources(self.proc(name))

    def fd_kinds(self, name: str) -> collections.Counter[str]:
        """One process tree's open fds by kind and process (`process_tree.tree_fd_kinds`)."""
        return tree_fd_kinds(self.proc(name))

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def decode_used_tokens(self) -> int:
        """KV slots the decode server holds right now (SGLang's /v1/loads), for leak checks."""
        r = requests.get(self.decode_url + "/v1/loads", timeout=10)
        r.raise_for_status()
        loads = r.json()["loads"]
        return sum(entry["num_used_tokens"] for entry in loads)

    def decode_tcp_address(self, port: int) -> str:
        """tcp://host:port of a port the decode server listens on (e.g. its
        --lynx-spec-stream-port), as reachable from this process."""
        host = next(p.host_ip for p in self._procs if p.name == "decode")
        return "tcp://" + self._reachable(host, port).removeprefix("http://")

    def kill(self, name: str) -> None:
        """SIGKILL one process tree (fault tests)."""
        popen = self.proc(name)
        for proc in process_tree(popen):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        popen.wait(timeout=self.spec.stop_timeout_s)

    def restart(self, name: str) -> None:
        """Start a killed process again with the same command line (and ports); wait healthy."""
        old = next(p for p in self._procs if p.name == name)
        if old.popen.poll() is None:
            raise ClusterError(f"{name} is still running; kill it first")
        self._procs.remove(old)
        self._wait_healthy([self._spawn(name, old.cmd, old.health_url, old.host_ip)])

    def stop(self) -> None:
        # Every tree is listed before anything is signalled: SGLang's scheduler can outlive its
        # parent, and once the parent is gone it is no longer its descendant.
        trees = [(p, process_tree(p.popen)) for p in reversed(self._procs)]
        owner = {proc.pid: p.name for p, tree in trees for proc in tree}
        procs = [proc for _, tree in trees for proc in tree]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        alive = wait_exited(procs, self.spec.stop_timeout_s)
        for proc in alive:
            logger.warning("%s: pid %d still running %.0f s after SIGTERM; killing",
                           owner[proc.pid], proc.pid, self.spec.stop_timeout_s)
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        wait_exited(alive, 5.0)
        for p, _ in trees:
            # psutil may have reaped the server already; this settles Popen's own record of it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
        self._procs.clear()
        for fwd in self._forwarders:
            fwd.close()
        self._forwarders.clear()
        if self._link is not None:
            self._link.close()
            self._link = None


def _distinct_free_ports(n: int) -> list[int]:
    """`n` free ports, no two alike: each `free_port` releases its port before the next call,
    and the kernel may hand the same one out again (seen: a decode given its bootstrap port,
    whose server then held the decode's HTTP port)."""
    ports: list[int] = []
    for _ in range(20 * n):
        port = free_port()
        if port not in ports:
            ports.append(port)
            if len(ports) == n:
                return ports
    raise ClusterError(f"could not find {n} distinct free ports")


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        return requests.get(url, timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


# ---- `lynx-sglang up` ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the embedded SmolLM2-135M, converted once)")
    parser.add_argument("--mode", choices=[m.value for m in ClusterMode], default="pd",
                        help="pd: prefill + decode + router; single: one plain server")
    parser.add_argument("--transfer-backend", choices=TRANSFER_BACKENDS, default="lynx",
                        help="KV transfer backend of the PD pair (default lynx)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where logs go (default: a new temporary folder)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="PD only (root): prefill and decode in two network namespaces joined "
                             "by a link shaped to RATE (e.g. 1gbit, 500mbit)")
    parser.add_argument("--link-qdisc", choices=("fifo", "prio", "htb"), default="prio",
                        help="queueing on the shaped link: fifo, prio (pfifo_fast: strict priority "
                             "by IP TOS, which the Lynx TCP transport sets per stream), htb")
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--tls", action="store_true",
                        help="Lynx PD: TLS 1.3 on the transport's data connections, with a CA and "
                             "a certificate made for this cluster in the run dir (tls/)")
    parser.add_argument("server_args", nargs="*", metavar="-- SERVER_ARG",
                        help="extra SGLang/Lynx server flags after `--`, e.g. -- --lynx-target "
                             "exact. Every server runs SGLang's default overlap scheduler unless "
                             "-- --disable-overlap-schedule")


def up_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster `up` starts: SGLang's default overlap scheduler unless the server flags after
    `--` turn it off (ClusterSpec then passes that flag, once, to every server)."""
    from ..model import embedded_model_dir

    no_overlap = "--disable-overlap-schedule"
    return ClusterSpec(
        model_path=str(args.model or embedded_model_dir()),
        mode=ClusterMode(args.mode),
        transfer_backend=args.transfer_backend,
        run_dir=args.run_dir,
        server_args=tuple(a for a in args.server_args if a != no_overlap),
        overlap_schedule=no_overlap not in args.server_args,
        max_total_tokens=args.max_total_tokens,
        startup_timeout_s=args.startup_timeout_s,
        link=args.link,
        link_qdisc=args.link_qdisc,
        tls=args.tls,
    )


def run(args: argparse.Namespace) -> int:
    spec = up_spec(args)
    stop = False

    def _on_signal(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with Cluster(spec) as cluster:
        print(json.dumps({"url": cluster.url, "run_dir": str(cluster.run_dir),
                          "prefill": cluster.prefill_url, "decode": cluster.decode_url}),
              flush=True)
        while not stop:
            for p in cluster._procs:
                if p.popen.poll() is not None:
                    print(f"{p.name} exited with code {p.popen.returncode}; stopping",
                          file=sys.stderr)
                    return 1
            time.sleep(1.0)
    return 0
