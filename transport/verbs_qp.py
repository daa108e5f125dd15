"""`QpSetup`: the `verbs` backend's per-session RDMA objects and the QP exchange that connects them.

A session has two RC QPs, one per stream (ANCHOR, RESIDUAL), so a queued Residual work request
never sits in front of an Anchor one, with a ring of registered notice buffers each way
(`Lane`), and a send and a receive CQ (`VerbsSession`). `QpSetup` creates them
(`create`, at `session_prepare`: the QP numbers go to the peer in the authenticated handshake),
takes them to RTR/RTS against the peer's QP numbers, GID and MTU (`connect`, at
`session_connect`; everything the peer sent is checked first: it is untrusted input) and
destroys them (`destroy`). Used by `verbs.VerbsBackend` under its lock; `post_recv` (re-arming
a notice buffer) also by the completion handling (`verbs_recv`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .types import Stream, TransportError
from .verbs_options import VerbsOptions
from .verbs_wire import SLOT_BYTES, WR_RECV, wr_id

PORT = 1
_MTU_ENUM_NAMES = {256: "IBV_MTU_256", 512: "IBV_MTU_512", 1024: "IBV_MTU_1024",
                   2048: "IBV_MTU_2048", 4096: "IBV_MTU_4096"}


@dataclass
class Lane:
    """One stream's RC QP with its notice rings, queue and in-flight bookkeeping."""

    stream: Stream
    qp: Any
    send_mr: Any
    recv_mr: Any
    limit: int  # chunks (+ FINs) in flight at most
    free_slots: list[int]
    queue: deque = field(default_factory=deque)  # verbs_send.QueuedOp, in post order
    # slot -> (request id, bytes of the chunk; -1 for a FIN)
    inflight: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class VerbsSession:
    sid: bytes
    send_cq: Any
    recv_cq: Any
    lanes: tuple[Lane, Lane]
    connected: bool = False
    probe_after: float = 0.0
    probe_inflight: bool = False
    failed: bool = False
    # weighted mode: data bytes posted per stream since both became backlogged
    share_bytes: list[int] = field(default_factory=lambda: [0, 0])
    # receiver: request id -> the registrations of its announced extents (`expose`)
    exposed: dict[int, list] = field(default_factory=dict)
    peer_requires_checksum: bool = True  # what the peer's local_info says


@dataclass(frozen=True)
class PeerPath:
    """What `QpSetup.connect` needs of the peer, checked (`QpSetup.peer_path`)."""

    qpns: list[int]
    dgid: Any
    mtu_enum: Any


class QpSetup:
    """Creates, connects and destroys sessions' QPs, CQs and notice rings (see the module
    docstring). Not thread-safe: the backend calls it under its lock."""

    def __init__(self, v: Any, ctx: Any, pd: Any, opts: VerbsOptions, gid_index: int,
                 active_mtu: int):
        self._v = v
        self._ctx = ctx
        self._pd = pd
        self._opts = opts
        self._gid_index = gid_index
        self._active_mtu = active_mtu

    def create(self, session_id: bytes) -> VerbsSession:
        v, e, o = self._v, self._v.e, self._opts
        slots_a, slots_r = o.max_outstanding, o.residual_outstanding
        recv_slots = max(o.max_outstanding, o.residual_outstanding) + 4
        created: list[Any] = []  # closed again, newest first, if anything below fails
        try:
            send_cq = v.CQ(self._ctx, 2 * (slots_a + slots_r) + 8)
            created.append(send_cq)
            recv_cq = v.CQ(self._ctx, 2 * recv_slots + 8)
            created.append(recv_cq)
            lanes = []
            for stream, slots in ((Stream.ANCHOR, slots_a), (Stream.RESIDUAL, slots_r)):
                # Each chunk is an unsignaled WRITE + a signaled SEND (two send WRs per
                # slot), plus one keepalive probe.
                cap = v.QPCap(max_send_wr=2 * slots + 1, max_recv_wr=recv_slots,
                              max_send_sge=1, max_recv_sge=1)
                qp = v.QP(self._pd, v.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=send_cq,
                                                 rcq=recv_cq, cap=cap))
                created.append(qp)
                at = v.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=PORT)
                at.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                at.pkey_index = 0
                qp.to_init(at)
                send_mr = v.MR(self._pd, slots * SLOT_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
                created.append(send_mr)
                recv_mr = v.MR(self._pd, recv_slots * SLOT_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
                created.append(recv_mr)
                lane = Lane(stream, qp, send_mr, recv_mr, slots, list(range(slots)))
                for slot in range(recv_slots):
                    self.post_recv(lane, slot)
                lanes.append(lane)
        except v.PyverbsError as exc:
            for obj in reversed(created):
                obj.close()
            raise TransportError(f"creating the session's QPs/CQs/notice buffers failed: "
                                 f"{exc}") from exc
        return VerbsSession(session_id, send_cq, recv_cq, (lanes[0], lanes[1]))

    def peer_path(self, remote_info: dict, remote_prepare: dict) -> PeerPath:
        """The peer's QP numbers, GID and the path MTU from what it sent; TransportError if any
        of it is malformed."""
        v, e, o = self._v, self._v.e, self._opts
        try:
            qpns = [int(q) for q in remote_prepare["qpn"]]
            dgid = v.GID(str(remote_info["gid"]))
            mtu = min(self._active_mtu, int(remote_info["mtu"]), o.path_mtu or 4096)
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"bad verbs peer info {remote_info!r} / {remote_prepare!r}: "
                                 f"{exc}") from exc
        if len(qpns) != 2:
            raise TransportError(f"peer announced {len(qpns)} QPs, need 2 (ANCHOR, RESIDUAL)")
        mtu_enum = getattr(e, _MTU_ENUM_NAMES[max(m for m in _MTU_ENUM_NAMES if m <= mtu)])
        return PeerPath(qpns, dgid, mtu_enum)

    def connect(self, s: VerbsSession, peer: PeerPath) -> None:
        """Take both QPs of `s` to RTR against the peer's, then to RTS."""
        v, e, o = self._v, self._v.e, self._opts
        for lane, rqpn in zip(s.lanes, peer.qpns, strict=True):
            anchor = lane.stream is Stream.ANCHOR
            at = v.QPAttr(qp_state=e.IBV_QPS_RTR, port_num=PORT)
            at.path_mtu = peer.mtu_enum
            at.dest_qp_num = rqpn
            at.rq_psn = 0
            at.max_dest_rd_atomic = 1
            at.min_rnr_timer = 12
            gr = v.GlobalRoute(dgid=peer.dgid, sgid_index=self._gid_index, hop_limit=64,
                               traffic_class=o.anchor_tc if anchor else o.residual_tc)
            at.ah_attr = v.AHAttr(gr=gr, is_global=1, port_num=PORT,
                                  sl=o.anchor_sl if anchor else o.residual_sl)
            lane.qp.to_rtr(at)
            at = v.QPAttr(qp_state=e.IBV_QPS_RTS)
            at.sq_psn = 0
            at.timeout = o.ack_timeout
            at.retry_cnt = o.retry_cnt
            at.rnr_retry = 7  # "infinite": a slow receiver is not a dead one
            at.max_rd_atomic = 1
            lane.qp.to_rts(at)
        s.connected = True

    @staticmethod
    def destroy(s: VerbsSession) -> int:
        """Close QPs first (flushes their WRs), then the exposed extents, rings and CQs; returns
        how many exposed extents were closed."""
        s.failed = True
        for lane in s.lanes:
            lane.qp.close()
        closed = 0
        for mrs in s.exposed.values():
            for mr in mrs:
                mr.close()
                closed += 1
        s.exposed.clear()
        for lane in s.lanes:
            lane.send_mr.close()
            lane.recv_mr.close()
        s.send_cq.close()
        s.recv_cq.close()
        return closed

    def post_recv(self, lane: Lane, slot: int) -> None:
        """Arm notice buffer `slot` of `lane`'s receive ring."""
        v = self._v
        sge = v.SGE(lane.recv_mr.buf + slot * SLOT_BYTES, SLOT_BYTES, lane.recv_mr.lkey)
        lane.qp.post_recv(v.RecvWR(wr_id=wr_id(WR_RECV, int(lane.stream), slot), num_sge=1,
                                   sg=[sge]))
