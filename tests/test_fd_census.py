"""The fault matrix's fd census (`Cluster.fd_kinds`, `faults.cells.fd_growth`): what a leak check's
extra fds are and in which process, read from /proc of a real stand-in server (no SGLang)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lynx_tools.cluster import process_tree
from lynx_tools.cluster.local import Cluster, _Proc
from lynx_tools.cluster.process_tree import fd_kind
from lynx_tools.cluster.spec import ClusterMode, ClusterSpec
from lynx_tools.faults.cells import fd_growth

# Opens 3 eventfds and a socket pair, says so, then sleeps.
SERVER = """
import os, socket, sys, time
from pathlib import Path
held = [os.eventfd(0) for _ in range(3)], socket.socketpair()
Path(sys.argv[1]).write_text("ready")
time.sleep(600)
"""


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(ClusterSpec("unused", ClusterMode.SINGLE, run_dir=tmp_path, stop_timeout_s=1.0))
    yield c
    c.stop()


def test_the_census_names_each_kind_in_its_process(cluster, tmp_path):
    ready = tmp_path / "ready"
    popen = subprocess.Popen([sys.executable, "-c", SERVER, str(ready)], start_new_session=True)
    cluster._procs.append(_Proc("server", [], popen, tmp_path / "server.log", "", "127.0.0.1"))
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the stand-in server never started"
        time.sleep(0.02)
    kinds = cluster.fd_kinds("server")
    who = Path(sys.executable).name[:15]  # the kernel's comm, as psutil names the process
    assert kinds[f"{who} anon_inode:[eventfd]"] == 3
    assert kinds[f"{who} socket"] == 2
    assert sum(kinds.values()) == cluster.resources("server").fds


def test_fd_kind_drops_what_differs_per_fd():
    assert fd_kind("socket:[123456]") == "socket"
    assert fd_kind("pipe:[99]") == "pipe"
    assert fd_kind("anon_inode:[eventpoll]") == "anon_inode:[eventpoll]"
    assert fd_kind("/dev/shm/torch_123") == "file"


def test_growth_lists_what_changed_largest_first():
    base = collections.Counter({"sched socket": 10, "sched anon_inode:[eventfd]": 4, "http file": 2})
    now = collections.Counter({"sched socket": 11, "sched anon_inode:[eventfd]": 21, "http pipe": 1,
                               "http file": 2})
    assert fd_growth(base, now) == "sched anon_inode:[eventfd] +17, sched socket +1, http pipe +1"
    assert fd_growth(base, collections.Counter({"sched socket": 9, "sched anon_inode:[eventfd]": 4,
                                                "http file": 2})) == "sched socket -1"
    assert fd_growth(base, base) == "no change by kind"



def test_a_process_gone_while_it_is_counted_is_left_out(cluster, tmp_path, monkeypatch):
    """A process that exits between psutil naming it and /proc listing its fds (the listing then
    raises FileNotFoundError) is left out of the census instead of ending the matrix run. The
    race cannot be timed from a test, so os.listdir is made to lose it for a real process."""
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    cluster._procs.append(_Proc("server", [], popen, tmp_path / "server.log", "", "127.0.0.1"))

    listdir = os.listdir

    def gone(path):
        if str(path).endswith(f"/{popen.pid}/fd"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return listdir(path)  # psutil lists /proc with it too

    monkeypatch.setattr(process_tree.os, "listdir", gone)
    assert cluster.fd_kinds("server") == collections.Counter()
