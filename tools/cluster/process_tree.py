"""The process tree of a server started in its own session: finding it (`process_tree`), counting
what it holds (`tree_resources`, `tree_fd_kinds`: the leak checks' census), what it has used
(`tree_cpu_s`: the load benchmark's CPU per request) and waiting for it to
exit (`wait_exited`). Used by `lynx_tools.cluster.local.Cluster` and the fault matrix.
"""

from __future__ import annotations

import collections
import contextlib
import os
import subprocess
import time
from dataclasses import dataclass

import psutil

# How far a server's threads and fds may rise above an idle baseline before a leak check flags
# it: SGLang's own pools start threads and open sockets lazily.
THREAD_SLACK, FD_SLACK = 8, 16


@dataclass(frozen=True)
class Resources:
    """What one server's process tree holds: threads, open fds, resident memory."""

    threads: int
    fds: int
    rss_mib: float

    def grown_past(self, baseline: Resources) -> bool:
        return (self.threads > baseline.threads + THREAD_SLACK
                or self.fds > baseline.fds + FD_SLACK)



def tree_resources(popen: subprocess.Popen) -> Resources:
    """Threads, fds and RSS of one process tree now (leak checks)."""
    threads = fds = rss = 0
    for proc in process_tree(popen):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            threads += proc.num_threads()
            fds += proc.num_fds()
            rss += proc.memory_info().rss
    return Resources(threads, fds, round(rss / (1 << 20), 1))


def tree_cpu_s(popen: subprocess.Popen) -> float:
    """CPU seconds (user + system) the live processes of one tree have used so far, their
    waited-for children included; a process gone by the time it is read is left out."""
    total = 0.0
    for proc in process_tree(popen):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def tree_fd_kinds(popen: subprocess.Popen) -> collections.Counter[str]:
    """One process tree's open fds by what they are ("socket", "anon_inode:[eventfd]", "pipe",
    "file"), keyed by the process's name: says where a leak check's extra fds sit."""
    kinds: collections.Counter[str] = collections.Counter()
    for proc in process_tree(popen):
        # A process (or an fd) that is gone by the time /proc is read is left out.
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            who = proc.name()
            for fd in os.listdir(f"/proc/{proc.pid}/fd"):
                with contextlib.suppress(OSError):
                    kinds[f"{who} {fd_kind(os.readlink(f'/proc/{proc.pid}/fd/{fd}'))}"] += 1
    return kinds


def fd_kind(target: str) -> str:
    """What an fd's /proc link names, without the part that differs per fd (inode numbers, paths)."""
    if target.startswith("anon_inode:"):
        return target
    if ":" in target:
        return target.split(":", 1)[0]
    return "file"


def process_tree(popen: subprocess.Popen) -> list[psutil.Process]:
    """A process started with its own session (`Cluster._spawn`) while it runs, its descendants,
    and every process still in its process group: a child whose parent died is re-parented out of
    the tree but stays in the group. Empty when nothing of it is left."""
    found: dict[int, psutil.Process] = {}
    # Once reaped, its pid may belong to someone else.
    if popen.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(popen.pid)
            found[root.pid] = root
            found.update((c.pid, c) for c in root.children(recursive=True))
    for proc in psutil.process_iter():
        with contextlib.suppress(ProcessLookupError):
            if proc.pid not in found and os.getpgid(proc.pid) == popen.pid:
                found[proc.pid] = proc
    return list(found.values())


def _exited(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_exited(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """`psutil.wait_procs` until `timeout_s`, returning those still running, where a zombie counts
    as exited: psutil waits for an orphan's zombie until init reaps it, and the init of many
    containers never does."""
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive:
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, min(0.5, deadline - time.monotonic())))
        alive = [p for p in alive if not _exited(p)]
        if time.monotonic() >= deadline:
            break
    return alive
