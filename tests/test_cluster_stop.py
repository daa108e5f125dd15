"""How `Cluster.stop()` and `Cluster.kill()` end a server's whole process tree (psutil), on small
stand-in trees (a Python parent with `sleep` children), no SGLang: SIGTERM first, SIGKILL for
what outlives the deadline (logged), and a child whose parent died before the stop (re-parented,
but still in the server's process group) is found too. Also which scheduler the cluster `up`
starts runs (`up_spec`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lynx_tools.cluster.local import Cluster, _Proc
from lynx_tools.cluster.spec import ClusterError, ClusterMode, ClusterSpec, split_cpus

# The stand-in server: starts a child that ignores SIGTERM (SGLang's scheduler outliving its
# parent) and a plain one, writes their pids, then sleeps (or exits at once with "exit").
SERVER = """
import subprocess, sys, time
from pathlib import Path
ready = Path(sys.argv[1])
stubborn = subprocess.Popen(["sh", "-c", f"trap '' TERM; touch {ready}.stubborn; exec sleep 600"])
plain = subprocess.Popen(["sleep", "600"])
Path(f"{ready}.tmp").write_text(f"{stubborn.pid} {plain.pid}")
Path(f"{ready}.tmp").rename(ready)
if sys.argv[2] == "exit":
    sys.exit(1)
time.sleep(600)
"""


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def cluster(tmp_path):
    spec = ClusterSpec("unused", ClusterMode.SINGLE, run_dir=tmp_path, stop_timeout_s=1.0)
    c = Cluster(spec)
    yield c
    c.stop()


def _start(cluster: Cluster, tmp_path: Path, mode: str = "stay") -> tuple[int, int, int]:
    ready = tmp_path / "pids"
    popen = subprocess.Popen([sys.executable, "-c", SERVER, str(ready), mode],
                             start_new_session=True)  # as Cluster._spawn starts a server
    cluster._procs.append(_Proc("server", [], popen, tmp_path / "server.log", "", "127.0.0.1"))
    _wait_for(ready)
    _wait_for(Path(f"{ready}.stubborn"))
    stubborn, plain = map(int, ready.read_text().split())
    return popen.pid, stubborn, plain


def test_stop_ends_the_tree_and_kills_what_ignores_sigterm(cluster, tmp_path, caplog):
    pids = _start(cluster, tmp_path)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lynx_tools.cluster.local"):
        cluster.stop()
    assert all(_gone(pid) for pid in pids)
    assert time.monotonic() - t0 < 10
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"server: pid {pids[1]} still running 1 s after SIGTERM; killing"]


def test_stop_finds_a_child_whose_parent_already_died(cluster, tmp_path):
    _, stubborn, plain = _start(cluster, tmp_path, mode="exit")
    cluster.proc("server").wait(timeout=30)
    assert not _gone(stubborn) and not _gone(plain)  # orphans, out of the leader's tree
    cluster.stop()
    assert _gone(stubborn) and _gone(plain)


def test_kill_ends_the_whole_tree(cluster, tmp_path):
    pids = _start(cluster, tmp_path)
    cluster.kill("server")
    assert cluster.proc("server").returncode is not None
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a process of the killed tree survived"
        time.sleep(0.05)


def test_up_runs_sglangs_overlap_scheduler_unless_told_otherwise(tmp_path):
    """`lynx-sglang up` starts what SGLang deploys by default; `-- --disable-overlap-schedule`
    reaches every server once (not once from the operator and once from ClusterSpec)."""
    import argparse

    from lynx_tools.cluster.local import add_arguments, up_spec
    from lynx_tools.cluster.spec import server_command

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def command(*argv: str) -> list[str]:
        spec = up_spec(parser.parse_args(["--model", str(tmp_path), *argv]))
        return server_command(spec, 30000, "decode", 8998)

    assert "--disable-overlap-schedule" not in command("--", "--lynx-target", "exact")
    off = command("--", "--disable-overlap-schedule", "--lynx-target", "exact")
    assert off.count("--disable-overlap-schedule") == 1 and "--lynx-target" in off


def test_a_pinned_role_runs_on_its_cpus_and_what_it_starts_too(tmp_path):
    """`ClusterSpec.role_cpus`: the server and the children it starts run on the role's CPUs."""
    last = sorted(os.sched_getaffinity(0))[-1]
    c = Cluster(ClusterSpec("unused", run_dir=tmp_path, role_cpus={"decode": (last,)}))
    child = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
             "subprocess.run([sys.executable, '-c', "
             "'import os; print(sorted(os.sched_getaffinity(0)))'])")
    proc = c._spawn("decode", [sys.executable, "-c", child], "http://unused",
                    cpus=c.spec.role_cpus["decode"])
    assert proc.popen.wait(60) == 0
    assert proc.log_path.read_text().split() == [f"[{last}]", f"[{last}]"]


def test_role_cpus_are_checked_and_split_in_halves():
    usable = sorted(os.sched_getaffinity(0))
    with pytest.raises(ClusterError, match="unknown role 'router'"):
        ClusterSpec("m", role_cpus={"router": (usable[0],)})
    with pytest.raises(ClusterError, match="may use only"):
        ClusterSpec("m", role_cpus={"decode": (max(usable) + 1,)})
    with pytest.raises(ClusterError, match="needs the PD mode"):
        ClusterSpec("m", ClusterMode.SINGLE, role_cpus={"decode": (usable[0],)})
    if len(usable) >= 2:
        halves = split_cpus()
        assert halves["prefill"] + halves["decode"] == tuple(usable)
        assert len(halves["prefill"]) == len(usable) // 2


# A stand-in router: serves /health on the port its last argument names, or says what uvicorn says
# when another process holds that port.
ROUTER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
try:
    server = HTTPServer(("127.0.0.1", int(sys.argv[-1])), Health)
except OSError as exc:
    print(f"ERROR:    {exc}: address already in use", flush=True)
    sys.exit(3)
print("router up", flush=True)
server.serve_forever()
"""


def test_a_router_whose_port_was_taken_starts_on_another(tmp_path):
    """The router's port is chosen before the servers start; another process may bind it
    meanwhile: the router then starts on a new port (`Cluster._start_router`)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    c = Cluster(ClusterSpec("unused", ClusterMode.SINGLE, run_dir=tmp_path, stop_timeout_s=1.0))
    try:
        c._start_router([sys.executable, "-c", ROUTER, str(port)], "127.0.0.1", port)
        assert c.url != f"http://127.0.0.1:{port}"
        assert [p.name for p in c._procs] == ["router"] and c._procs[0].popen.poll() is None
        assert "address already in use" in (tmp_path / "router.log").read_text()
    finally:
        c.stop()
        taken.close()


def test_a_router_that_fails_otherwise_is_not_retried(tmp_path):
    c = Cluster(ClusterSpec("unused", ClusterMode.SINGLE, run_dir=tmp_path, stop_timeout_s=1.0))
    try:
        with pytest.raises(ClusterError, match="exited with code 2"):
            c._start_router([sys.executable, "-c", "import sys; sys.exit(2)", "1"], "127.0.0.1",
                            1)
        assert len(c._procs) == 1
    finally:
        c.stop()
