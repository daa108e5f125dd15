"""Helpers shared by the soft-RoCE guest test modules of the `verbs` backend (test_verbs_datapath.py,
test_verbs_faults.py): their marks (`GUEST_MARKS`), the RDMA devices present, verbs endpoints and a
connected pair of them, the kernel's view of RDMA resources, and a verbs_peer.py process to kill.

Device / GID index come from LYNX_RDMA_DEVICE / LYNX_RDMA_GID_INDEX (set by rdma_vm.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from session_pair import connected_pair

from lynx_transport import Endpoint, PriorityPolicy, Session, Stream

A, R = Stream.ANCHOR, Stream.RESIDUAL
KiB = 1 << 10
PEER = Path(__file__).with_name("verbs_peer.py")
# The surviving side's control-plane heartbeat timeout is long, so a peer death must be noticed
# by the verbs data path (failed work request / keepalive probe), not by the heartbeat.
LONG_HEARTBEAT_S = 60.0


def rdma_devices() -> list[str]:
    try:
        from pyverbs.device import get_device_list

        devices = get_device_list()
    except Exception:  # ImportError, or PyverbsRDMAError on a kernel without RDMA support
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


# The `pytestmark` of every guest test module: selected by `-m rdma_vm` (which also gives it the
# verbs `pair`, conftest.py), skipped where no RDMA device exists.
GUEST_MARKS = [
    pytest.mark.rdma_vm,
    pytest.mark.skipif(not rdma_devices(), reason="no RDMA device; run via scripts/rdma_vm.sh"),
]


def device_options(**extra) -> dict:
    opts: dict = {"device": os.environ.get("LYNX_RDMA_DEVICE") or None}
    if os.environ.get("LYNX_RDMA_GID_INDEX"):
        opts["gid_index"] = int(os.environ["LYNX_RDMA_GID_INDEX"])
    opts.update(extra)
    return opts


def verbs_endpoint(name: str, chunk: int = 64 * KiB, mode: str = "strict", **opts) -> Endpoint:
    return Endpoint(backend="verbs", name=name, peer_timeout_s=LONG_HEARTBEAT_S,
                    policy=PriorityPolicy(mode=mode, chunk_bytes=chunk),
                    backend_options=device_options(**opts))


def verbs_pair() -> Iterator[tuple[Endpoint, Endpoint, Session, Session]]:
    """`connected_pair` of two verbs endpoints ("rx" and "tx"), for the `pair` fixture
    (conftest.py) of the guest test modules."""
    yield from connected_pair(verbs_endpoint("rx"), verbs_endpoint("tx"), timeout=30)


def rdma_resources(kind: str) -> list[dict]:
    """The kernel's `rdma resource show KIND` entries (qp, mr, …) for the whole device."""
    out = subprocess.run(["rdma", "-j", "resource", "show", kind], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return json.loads(out or "[]")


def main_thread_mrs() -> list[dict]:
    """MRs registered by this process's main thread (the kernel records the creating task)."""
    return [r for r in rdma_resources("mr") if r.get("pid") == os.getpid()]


def spawn_peer(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE,
                            text=True)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One stdout line of `proc`, or fail after `timeout` s."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    assert box and box[0], f"peer printed nothing within {timeout} s (rc={proc.poll()})"
    return box[0].strip()
