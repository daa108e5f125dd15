"""`VerbsSender`: the `verbs` backend's send side, run by its progress thread for each session.

It schedules a session's queued writes by `PriorityPolicy` (strict: the Residual QP gets work
only while the Anchor is neither queued nor in flight; weighted: by bytes posted over each
stream's share), chunks them, and posts per chunk an RDMA WRITE straight from the source
region's registration and the DATA notice behind it (a FIN notice at a stream's end), within the
lane's in-flight limit; it also probes idle peers (`maybe_probe`). Called by
`verbs.VerbsBackend`'s progress thread under the backend lock.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

from .backend import FinOp, PriorityPolicy, WriteOp
from .types import TransportError
from .verbs_options import VerbsOptions
from .verbs_qp import Lane, VerbsSession
from .verbs_wire import SLOT_BYTES, WR_NOTICE, WR_PROBE, WR_WRITE, pack_data_notice, pack_fin_notice, wr_id


@dataclass
class QueuedOp:
    """A queued write (cursor = bytes already posted) or FIN, in post order on one lane."""

    op: WriteOp | FinOp
    cursor: int = 0


class VerbsSender:
    """Posts sessions' queued work and keepalive probes (see the module docstring)."""

    def __init__(self, v: Any, policy: PriorityPolicy, opts: VerbsOptions, mrs: dict,
                 stats: dict):
        self._v = v
        self._policy = policy
        self._mrs = mrs  # region id -> its local registration (the backend's, shared)
        self._stats = stats  # the backend's counters (shared)
        self._corrupt = opts._corrupt_notice

    def schedule(self, s: VerbsSession) -> None:
        anchor, residual = s.lanes
        if self._policy.mode == "strict" or not (anchor.queue and residual.queue):
            s.share_bytes = [0, 0]
            self._fill(s, anchor, budget=None)
            # Strict: the Residual waits until the Anchor is neither queued nor in flight; the
            # NIC would otherwise share the link between the two QPs while the Anchor drains.
            if self._policy.mode != "strict" or not (anchor.queue or anchor.inflight):
                self._fill(s, residual, budget=None)
            return
        # Weighted, both backlogged: one item at a time from whichever stream is below its byte
        # share. The stream that is due but has no free slot blocks the other: the share is
        # enforced on what enters the wire, not only on what is queued.
        share = self._policy.residual_share
        while True:
            posted_a, posted_r = s.share_bytes
            lane = residual if posted_r < share * (posted_a + posted_r) else anchor
            if not lane.queue or len(lane.inflight) >= lane.limit:
                return
            s.share_bytes[int(lane.stream)] += self._fill(s, lane, budget=1)

    def _fill(self, s: VerbsSession, lane: Lane, budget: int | None) -> int:
        """Post queued work on `lane` while slots are free (at most `budget` items); returns the
        data bytes posted."""
        posted = 0
        chunk = self._policy.chunk_bytes
        while lane.queue and len(lane.inflight) < lane.limit and (budget is None or budget > 0):
            item = lane.queue[0]
            slot = lane.free_slots.pop()
            op = item.op
            if isinstance(op, FinOp):
                self._post_notice(s, lane, slot,
                                  pack_fin_notice(op.stream, op.request_id, op.total, op.aux))
                lane.inflight[slot] = (op.request_id, -1)
                lane.queue.popleft()
            else:
                n = min(chunk, op.length - item.cursor)
                self._post_chunk(s, lane, op, item.cursor, n, slot)
                lane.inflight[slot] = (op.request_id, n)
                item.cursor += n
                posted += n
                if item.cursor >= op.length:
                    lane.queue.popleft()
            if budget is not None:
                budget -= 1
        key = f"peak_inflight_{lane.stream.name.lower()}"
        self._stats[key] = max(self._stats[key], len(lane.inflight))
        return posted

    def _post_notice(self, s: VerbsSession, lane: Lane, slot: int, payload: bytes) -> None:
        v, e = self._v, self._v.e
        if self._corrupt is not None:
            payload = self._corrupt(s.sid, lane.stream, payload)
        lane.send_mr.write(payload, len(payload), slot * SLOT_BYTES)
        sge = v.SGE(lane.send_mr.buf + slot * SLOT_BYTES, len(payload), lane.send_mr.lkey)
        lane.qp.post_send(v.SendWR(wr_id=wr_id(WR_NOTICE, int(lane.stream), slot),
                                   opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge],
                                   send_flags=e.IBV_SEND_SIGNALED))

    def _post_chunk(self, s: VerbsSession, lane: Lane, op: WriteOp, cursor: int, n: int,
                    slot: int) -> None:
        """RDMA WRITE of op's bytes [cursor, cursor + n) followed by its DATA notice."""
        v, e = self._v, self._v.e
        mr = self._mrs.get(op.src.id)
        if mr is None:
            raise TransportError(f"source region {op.src.id} is not registered with verbs")
        src_addr = op.src.addr + op.src_offset + cursor
        crc = (zlib.crc32(op.src.slice(op.src_offset + cursor, n))
               if op.checksum or s.peer_requires_checksum else None)
        wr = v.SendWR(wr_id=wr_id(WR_WRITE, int(lane.stream), slot),
                      opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.SGE(src_addr, n, mr.lkey)])
        # the target registration starts at the extent's offset (see `VerbsBackend.expose`)
        wr.set_wr_rdma(op.dst_info["rkey"],
                       op.dst_info["addr"] + op.dst_offset - op.dst_extent.offset + cursor)
        lane.qp.post_send(wr)
        self._post_notice(s, lane, slot, pack_data_notice(
            op.stream, op.request_id, op.dst_region_id, op.dst_offset + cursor, n, crc))

    def maybe_probe(self, s: VerbsSession) -> None:
        """Probe the peer of an idle session whose probe is due."""
        if s.probe_inflight or time.monotonic() < s.probe_after:
            return
        if any(lane.inflight for lane in s.lanes):
            return  # traffic in flight already proves (or disproves) the peer is alive
        v, e = self._v, self._v.e
        lane = s.lanes[0]
        # Zero-length RDMA WRITE: acknowledged by the peer's NIC, touches no memory, needs no rkey.
        wr = v.SendWR(wr_id=wr_id(WR_PROBE, 0, 0), opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                      sg=[v.SGE(lane.recv_mr.buf, 0, lane.recv_mr.lkey)],
                      send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(0, 0)
        lane.qp.post_send(wr)
        s.probe_inflight = True
        self._stats["probes"] += 1
