"""`VerbsReceiver`: the `verbs` backend's completion handling, run by its progress thread.

It polls a session's send CQ (a chunk's notice completed: its bytes were sent; a probe came
back; a failed work request fails the session) and receive CQ (a peer's notice: parsed with
`verbs_wire.parse_notice`, untrusted input, its buffer re-armed), turning each into an event the
backend fires outside its lock. A DATA notice means the chunk's bytes have already landed
(one-sided WRITE); `land` validates them through `BackendHooks.open_incoming` and their CRC
before they count. Called by `verbs.VerbsBackend`: `poll` under its lock, `land` outside it.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from typing import Any

from .backend import BackendHooks, Refused
from .types import FailureReason, Stream
from .verbs_options import VerbsOptions
from .verbs_qp import Lane, QpSetup, VerbsSession
from .verbs_wire import DATA, SLOT_BYTES, WR_NOTICE, WR_PROBE, NoticeError, parse_notice, split_wr_id

log = logging.getLogger("lynx_transport.verbs")


class VerbsReceiver:
    """Completions and incoming notices of sessions (see the module docstring)."""

    def __init__(self, v: Any, hooks: BackendHooks, opts: VerbsOptions, qps: QpSetup,
                 lock: threading.Lock, stats: dict, require_checksum: bool):
        self._v = v
        self._hooks = hooks
        self._opts = opts
        self._qps = qps
        self._lock = lock  # the backend's: guards `stats` when `land` runs outside it
        self._stats = stats  # the backend's counters (shared)
        self._require_checksum = require_checksum

    def poll(self, s: VerbsSession, events: list[tuple]) -> None:
        e = self._v.e
        n, wcs = s.send_cq.poll(num_entries=32)
        for wc in wcs[:n]:
            kind, lane_i, slot = split_wr_id(wc.wr_id)
            if kind == WR_PROBE:
                s.probe_inflight = False
                s.probe_after = time.monotonic() + self._opts.keepalive_s
            if wc.status != e.IBV_WC_SUCCESS:
                self._fail_session(s, events, f"work request failed on the "
                                   f"{Stream(lane_i).name} QP: wc status {wc.status} "
                                   f"({_wc_status_name(e, wc.status)})")
                return
            if kind == WR_NOTICE:
                lane = s.lanes[lane_i]
                rid, nbytes = lane.inflight.pop(slot)
                lane.free_slots.append(slot)
                if nbytes >= 0:
                    self._stats["chunks_sent"] += 1
                    self._stats["bytes_sent"] += nbytes
                    events.append(("sent", s.sid, rid, lane.stream, nbytes))
        n, wcs = s.recv_cq.poll(num_entries=32)
        for wc in wcs[:n]:
            _, lane_i, slot = split_wr_id(wc.wr_id)
            if wc.status != e.IBV_WC_SUCCESS:
                self._fail_session(s, events, f"receive failed on the {Stream(lane_i).name} QP: "
                                   f"wc status {wc.status} ({_wc_status_name(e, wc.status)})")
                return
            lane = s.lanes[lane_i]
            raw = lane.recv_mr.read(wc.byte_len, slot * SLOT_BYTES)
            self._qps.post_recv(lane, slot)
            self._stats["notices_received"] += 1
            self._parse_notice(s, lane, raw, events)
            s.probe_after = time.monotonic() + self._opts.keepalive_s

    def _parse_notice(self, s: VerbsSession, lane: Lane, raw: bytes, events: list[tuple]) -> None:
        try:
            n = parse_notice(raw, lane.stream)
        except NoticeError as exc:
            self._fail_session(s, events, str(exc), FailureReason.CORRUPTION)
            return
        if n.kind == DATA:
            events.append(("data", s.sid, lane.stream, n.request_id, n.region_id, n.offset,
                           n.length, n.has_crc, n.crc))
        else:
            events.append(("fin", s.sid, n.request_id, lane.stream, n.length, n.aux))

    @staticmethod
    def _fail_session(s: VerbsSession, events: list[tuple], detail: str,
                      reason: FailureReason = FailureReason.PEER_DIED) -> None:
        s.failed = True
        events.append(("lost", s.sid, reason, detail))

    def land(self, sid: bytes, stream: Stream, request_id: int, region_id: int, offset: int,
             length: int, has_crc: bool, crc: int) -> None:
        """A DATA notice arrived: the chunk's bytes are already in place; validate and count."""
        try:
            inc = self._hooks.open_incoming(sid, request_id, stream, region_id, offset, length)
        except Refused as exc:
            with self._lock:
                self._stats["refused"] += 1
            log.debug("verbs chunk refused: %s", exc)
            return
        # finish() takes the stream lock that guard() holds: decide inside, report after.
        verdict: tuple[FailureReason, str] | None = None
        with inc.guard() as ok:
            if not ok:
                verdict = (FailureReason.RELEASED, "request no longer pending")
            elif not has_crc and self._require_checksum:
                verdict = (FailureReason.CORRUPTION, f"chunk on region {region_id} [{offset}, "
                           f"{offset + length}) without a checksum: this endpoint requires them")
            elif has_crc and zlib.crc32(inc.view) != crc:
                verdict = (FailureReason.CORRUPTION,
                           f"CRC32 mismatch on region {region_id} [{offset}, {offset + length})")
        if verdict is None:
            inc.finish(length)
            return
        if verdict[0] is FailureReason.CORRUPTION:
            with self._lock:
                self._stats["crc_errors"] += 1
        inc.finish(0, False, *verdict)


def _wc_status_name(e: Any, status: int) -> str:
    """ibv_wc_status name (pyverbs 44 has no status-to-string helper)."""
    for name in dir(e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") and getattr(e, name) == status:
            return name
    return "IBV_WC_SUCCESS" if status == 0 else "unknown status"
