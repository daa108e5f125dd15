"""A room the decode fails while its prefill's Success arrives: SGLang must never see Success
first (issue 42). SGLang's receiver keeps the first Success or Failed its poll reads
(`CommonKVReceiver._poll_with_status`), so a Success that reaches `request_status` before the
Failed lets the request decode on KV that failed, whatever comes after.

Driven for real below the receiver: SGLang's own status bookkeeping (`CommonKVManager.update_status`
through `LynxKVManager.update_status` and `report_status`, on a manager without sockets or threads),
a `DecodeApplier` with a real staging pool, KV pool view and loopback transport endpoint, whose
own thread fails each room (no prefill session within the waiting budget), while other threads
deliver the prefill's Success for the same room through `LynxKVManager.update_status`, as SGLang's
status thread does. They repeat it until the room's status settles, so that one lands in whatever
gap the failure leaves; the interpreter's switch interval is shortened so the threads interleave
at a fine grain. No pause is injected anywhere.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from loop_thread import LoopThread

from lynx_sglang.backend.decode.applier import DecodeApplier, DecodeLink
from lynx_sglang.backend.decode.room import Source
from lynx_sglang.backend.pool import KVPoolView
from lynx_sglang.backend.staging import StagingPool
from lynx_sglang.config import LynxConfig
from lynx_sglang.recorder import Recorder
from lynx_transport import Endpoint

# Rooms raced per run; the acceptance run is LYNX_RACE_ROOMS=10000.
ROOMS = int(os.environ.get("LYNX_RACE_ROOMS", "300"))
# Threads delivering each room's Success: without the fix, with one thread the Success landed in
# the failure's gap in 0-10% of rooms (a run of 300 could miss it) on a loaded 2-core machine;
# with two, in 8-30%.
SUCCESS_THREADS = 2
WAITING_S = 0.005  # the budget after which the applier fails a room that got no prefill session
PREFILL = ("127.0.0.2", 4000)  # a prefill rank that never opens its session
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def sgl(sglang_in_process):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from lynx_sglang.backend.manager import LynxKVManager

    return SimpleNamespace(KVPoll=KVPoll, DisaggregationMode=DisaggregationMode,
                           LynxKVManager=LynxKVManager)


class _StatusHistory(dict):
    """SGLang's `request_status`, remembering every status written per room."""

    def __init__(self):
        super().__init__()
        self.written: dict[int, list] = defaultdict(list)

    def __setitem__(self, room, status):
        self.written[room].append(status)
        super().__setitem__(room, status)


def _decode_manager(sgl):
    """A decode LynxKVManager holding only SGLang's status bookkeeping (what CommonKVManager's
    constructor sets for it)."""
    mgr = sgl.LynxKVManager.__new__(sgl.LynxKVManager)
    mgr.disaggregation_mode = sgl.DisaggregationMode.DECODE
    mgr.request_status = _StatusHistory()
    mgr.failure_lock = threading.Lock()
    mgr.failure_records = {}
    mgr._own_failures = {}
    from lynx_sglang.backend.decode.role import DecodeRole

    mgr.role = DecodeRole(mgr, lookup_prefill_rank=None)
    mgr._staging_outstanding = defaultdict(int)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr.deferred_bootstrap = None
    from lynx_sglang.idle import IdleWaiter
    from lynx_sglang.runtime import LynxRuntime

    recorder = Recorder.for_process()
    mgr.lynx_runtime = LynxRuntime(idle=IdleWaiter(recorder.metrics), recorder=recorder)
    return mgr


@pytest.fixture
def fine_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_a_failed_room_never_shows_success_first(sgl, fine_switching):
    KVPoll = sgl.KVPoll
    config = LynxConfig(transfer_timeout_s=WAITING_S)
    pool = KVPoolView([torch.zeros(64, 2, 64)], [torch.zeros(64, 2, 64)])
    mgr = _decode_manager(sgl)
    staging = StagingPool(64 << 20, mgr.lynx_runtime.recorder.metrics)
    with Endpoint(host="127.0.0.1") as endpoint:
        mgr.role.applier = DecodeApplier(
            config, lambda: pool, staging, endpoint.register(staging.buffer, name="staging"),
            endpoint, DecodeLink(mgr.report_status, lambda *a: None, lambda *a: None,
                                 lambda: None, lambda *a: None), mgr.lynx_runtime.recorder,
            waiting_timeout_s=WAITING_S)
        with LoopThread(mgr.applier.run, join_s=5):  # joined: its last room forgotten, too
            for room in range(1, ROOMS + 1):
                _race(mgr, KVPoll, room)
    written = mgr.request_status.written
    success_first = [room for room in range(1, ROOMS + 1) if KVPoll.Success in written[room]]
    print(f"{ROOMS} rooms raced, {len(success_first)} Success-then-Failed")
    assert not success_first, (f"{len(success_first)} of {ROOMS} failed rooms showed SGLang "
                               f"Success first, e.g. room {success_first[0]}: "
                               f"{written[success_first[0]]}")
    assert all(mgr.request_status[room] is KVPoll.Failed for room in range(1, ROOMS + 1))
    assert "no transport session" in mgr.failure_records[ROOMS]
    assert mgr.applier.tracked()["decode_rooms"] == 0 and staging.free_bytes() == staging.nbytes


def _race(mgr, KVPoll, room: int) -> None:
    """Open the room as SGLang's receiver does, register it with the applier (whose thread fails
    it once the waiting budget passes) and deliver its prefill's Success meanwhile."""
    mgr.update_status(room, KVPoll.Bootstrapping)
    mgr.update_status(room, KVPoll.WaitingForInput)
    assert mgr.applier.register(room, [Source(PREFILL)], np.arange(4), aux_index=0)
    deadline = time.monotonic() + SETTLE_S

    def deliver_success() -> None:
        while mgr.request_status[room] not in (KVPoll.Success, KVPoll.Failed):
            if time.monotonic() > deadline:
                return  # the main thread's wait below fails the test
            mgr.update_status(room, KVPoll.Success)

    threads = [threading.Thread(target=deliver_success) for _ in range(SUCCESS_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SETTLE_S)
    # The Failed of a room whose Success got through first may still be on its way.
    while mgr.request_status[room] is not KVPoll.Failed:
        assert time.monotonic() < deadline, f"room {room}: {mgr.request_status.written[room]}"
        time.sleep(0.0001)
