"""The `verbs` data-path backend: RDMA over pyverbs RC queue pairs (rdma-core; RoCE or InfiniBand).

Selected with `Endpoint(backend="verbs", backend_options={...})`; `lynx_transport.backend`
imports this module only when asked for, and pyverbs (Debian `python3-pyverbs`, a system package)
only when a `VerbsBackend` is constructed.

What it owns (one `VerbsBackend` per Endpoint):
* one device context + protection domain; one local memory registration per registered `Region`
  (`ibv_reg_mr` at `register_region`, *without* remote access: its rkey is worthless and never
  sent), the source of every RDMA WRITE from that region;
* per announced extent a registration of exactly that extent with remote-write access
  (`expose`, at `Session.announce`), whose address and rkey are what the announcement carries;
  deregistered at `withdraw` (`Session.release`, after the sender's drain fence) or when the
  session closes. The NIC itself refuses a WRITE outside the extent (remote access error);
* per session two RC QPs, one per stream (ANCHOR, RESIDUAL), so a queued Residual work request
  never sits in front of an Anchor one; the Anchor QP carries a higher service level / traffic
  class than the Residual QP so the fabric can prioritise it too; per QP a ring of registered
  notice buffers (send and receive);
* one progress thread that schedules queued writes (strict or weighted priority, chunked),
  posts work requests, polls completions, lands notices and probes idle peers.

Wire protocol on each QP: data moves by RDMA WRITE straight into the peer's extent; every chunk is
followed, on the same QP, by a SEND carrying a DATA notice (request, stream, region, offset,
length, CRC32 of the chunk). RC delivers the SEND after the WRITE's bytes are placed, so when the
receiver sees the notice the chunk has landed: it validates it through `BackendHooks.open_incoming`
(bounds, known request) and verifies the CRC before counting the bytes. A stream's completion is a
FIN notice (total + aux bytes + the CRC32 of the aux) behind its last chunk. Notices are parsed by
`parse_notice`; one that breaks the format fails the session (CORRUPTION). Outstanding chunks per
QP are bounded (`max_outstanding`; `residual_outstanding` for the Residual QP).

Bounds: the Endpoint refuses an out-of-bounds write on the sender before any work request is
posted. A peer that skips that check is stopped by the NIC: its WRITE can only name an rkey of an
extent announced to it, and the registration covers that extent alone, so a WRITE beyond it fails
with a remote access error — nothing lands, the QPs of that session go to the error state and the
session fails on both sides; other sessions are unaffected. Inside an announced extent bytes still
land before the receiver checks them (one-sided writes): a wrong CRC or a notice outside the bounds
fails the stream (CORRUPTION / OUT_OF_BOUNDS), and its bytes are never counted.
What this does not stop: rkeys are valid for every QP of the protection domain (one per
Endpoint), so an *authenticated* peer that guessed the rkey of an extent announced to another
session could write into that extent while it is announced; each wrong guess costs it its session
(remote access error) and a new authenticated handshake. Type-2 memory windows bound to one QP
would close that gap (recent rxe supports them; not used here).
What rxe (soft-RoCE) allows, and what is tested where: rxe registers sub-ranges of an already
registered buffer like any other memory (each pins the pages again) and checks every incoming
WRITE's rkey, range and access in its responder; a violation is answered with a remote-access NAK,
the sender's work request fails (IBV_WC_REM_ACCESS_ERR) and both QPs go to the error state.
tests/transport/test_verbs.py, in the soft-RoCE guest, checks that on rxe: per-extent
registrations and their removal at release, that the region-wide rkey is never published, that a
WRITE past its extent lands nothing and fails only its own session, the FIN aux CRC.
test_verbs_host.py checks on any host the notice format and, against a model of those NIC checks
(tests/transport/fake_pyverbs.py), this backend's use of the registrations.

Faults: a work request that fails (peer QP gone: transport retries exhausted) fails the session
(`session_lost`, PEER_DIED). Idle sessions are probed with a zero-length RDMA WRITE every
`keepalive_s`, so a dead peer is noticed within about keepalive_s + (retry_cnt + 1) × ack timeout
even when nothing is being sent.

Buffer ownership: the caller owns region memory (see `lynx_transport.memory`); this backend only
registers it. Source bytes of a write are read by the NIC until its chunk's completion is polled
(`drain` waits for that). Notice buffers are owned here and freed at `session_close`.
Receiver release (one-sided writes): chunks the sender already posted can land without the
receiver's help, so `one_sided_writes = True` makes `Session.release()` on the receiver wait for
the sender's RELEASED reply (sent once its drain finished) before it returns, and close the
session (destroying the QPs: the NIC drops what arrives later) if none comes within its timeout;
then the extents' registrations are dropped (a late WRITE would now fail at the NIC).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import struct
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

from .backend import MAX_CHUNK_BYTES, Backend, BackendHooks, FinOp, PriorityPolicy, Refused, WriteOp
from .memory import Region
from .types import (
    MAX_AUX_BYTES,
    BackendUnavailableError,
    FailureReason,
    Stream,
    TransportError,
)

log = logging.getLogger("lynx_transport.verbs")

# Notice on the wire (little endian): magic, kind, stream, has_crc, request id, region id,
# offset, length (FIN: total), crc32 (DATA: of the chunk; FIN: of the aux bytes that follow).
_NOTICE = struct.Struct("<4sBBBxQIQQI")
_MAGIC = b"LXV2"
_DATA, _FIN = 1, 2
_SLOT_BYTES = _NOTICE.size + MAX_AUX_BYTES
# wr_id layout: bits 62-63 kind, bits 32-33 lane, bits 0-31 slot.
_WR_NOTICE, _WR_WRITE, _WR_PROBE, _WR_RECV = 0, 1, 2, 3
_PORT = 1


class NoticeError(ValueError):
    """A notice that breaks the format (`parse_notice`): the session is failed (CORRUPTION)."""


@dataclass(frozen=True)
class Notice:
    """A parsed DATA or FIN notice. FIN: `aux` is None when it failed its CRC."""

    kind: int
    request_id: int
    region_id: int
    offset: int
    length: int  # DATA: the chunk's bytes; FIN: the stream's total
    has_crc: bool = False
    crc: int = 0
    aux: bytes | None = b""


def pack_data_notice(stream: Stream, request_id: int, region_id: int, offset: int, length: int,
                     crc: int | None) -> bytes:
    """The notice behind one chunk's RDMA WRITE (`crc` None: sent without a checksum)."""
    return _NOTICE.pack(_MAGIC, _DATA, int(stream), crc is not None, request_id, region_id,
                        offset, length, crc or 0)


def pack_fin_notice(stream: Stream, request_id: int, total: int, aux: bytes) -> bytes:
    return _NOTICE.pack(_MAGIC, _FIN, int(stream), 1, request_id, 0, 0, total,
                        zlib.crc32(aux)) + aux


def parse_notice(raw: bytes, stream: Stream) -> Notice:
    """Check a notice received on `stream`'s QP; NoticeError if no sender of this protocol would
    have sent it. A FIN whose aux fails its CRC parses, with `aux` None."""
    if len(raw) < _NOTICE.size:
        raise NoticeError(f"short notice ({len(raw)} B) on the {stream.name} QP")
    magic, kind, nstream, has_crc, rid, region, offset, length, crc = _NOTICE.unpack_from(raw)
    if magic != _MAGIC or nstream != int(stream) or has_crc > 1:
        raise NoticeError(f"malformed notice on the {stream.name} QP")
    tail = bytes(raw[_NOTICE.size:])
    if kind == _DATA:
        if tail or length > MAX_CHUNK_BYTES or offset + length >= 1 << 64:
            raise NoticeError(f"malformed DATA notice on the {stream.name} QP")
        return Notice(_DATA, rid, region, offset, length, bool(has_crc), crc)
    if kind == _FIN and has_crc and not region and not offset and len(tail) <= MAX_AUX_BYTES:
        return Notice(_FIN, rid, 0, 0, length, True, crc, tail if zlib.crc32(tail) == crc else None)
    raise NoticeError(f"malformed notice (kind {kind}) on the {stream.name} QP")


def _wr_id(kind: int, lane: int, slot: int) -> int:
    return (kind << 62) | (lane << 32) | slot


@dataclass(frozen=True)
class VerbsOptions:
    """`backend_options` of the verbs backend (unknown keys raise ValueError).

    device: RDMA device name (like SGLang's --disaggregation-ib-device, e.g. "mlx5_0" or "rxe0");
    None picks the only/first device. gid_index: None picks the GID whose IPv4-mapped address is
    the Endpoint's `host`, else the first IPv4-mapped (RoCE v2) GID, else index 0.
    anchor_sl/residual_sl: service levels; anchor_tc/residual_tc: GRH traffic class (DSCP << 2;
    0xb8 = EF, 0x20 = CS1). max_outstanding: chunks in flight on the Anchor QP;
    residual_outstanding: on the Residual QP (keeps an arriving Anchor behind few Residual chunks).
    ack_timeout: IB local ACK timeout exponent (4.096 µs × 2^n); retry_cnt: transport retries
    (6 by default: soft-RoCE treats 7 as "retry forever", so a dead peer would never be noticed).
    keepalive_s: probe interval for idle sessions. path_mtu: bytes (256…4096) or None for the
    port's active MTU.
    """

    device: str | None = None
    gid_index: int | None = None
    anchor_sl: int = 3
    residual_sl: int = 0
    anchor_tc: int = 0xB8
    residual_tc: int = 0x20
    max_outstanding: int = 16
    residual_outstanding: int = 2
    ack_timeout: int = 15
    retry_cnt: int = 6
    keepalive_s: float = 1.0
    path_mtu: int | None = None

    @classmethod
    def from_dict(cls, options: dict) -> VerbsOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown verbs backend option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**options)
        for name in ("anchor_sl", "residual_sl"):
            if not 0 <= getattr(opts, name) <= 15:
                raise ValueError(f"{name} must be in [0, 15]")
        for name in ("anchor_tc", "residual_tc"):
            if not 0 <= getattr(opts, name) <= 255:
                raise ValueError(f"{name} must be in [0, 255]")
        if opts.max_outstanding < 1 or opts.residual_outstanding < 1:
            raise ValueError("max_outstanding and residual_outstanding must be >= 1")
        if not 0 <= opts.ack_timeout <= 31 or not 0 <= opts.retry_cnt <= 7:
            raise ValueError("ack_timeout must be in [0, 31] and retry_cnt in [0, 7]")
        if opts.keepalive_s <= 0:
            raise ValueError("keepalive_s must be > 0")
        if opts.path_mtu is not None and opts.path_mtu not in (256, 512, 1024, 2048, 4096):
            raise ValueError("path_mtu must be one of 256, 512, 1024, 2048, 4096")
        if opts.gid_index is not None and opts.gid_index < 0:
            raise ValueError("gid_index must be >= 0")
        return opts


def _import_pyverbs() -> Any:
    """The pyverbs modules as one namespace; BackendUnavailableError if pyverbs is missing."""
    try:
        import pyverbs.enums as enums
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.device import Context, get_device_list
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR
    except ImportError as exc:
        raise BackendUnavailableError(
            "the 'verbs' backend needs pyverbs (rdma-core's Python bindings): install the "
            "system package (Debian/Ubuntu: apt-get install python3-pyverbs) and use a Python "
            f"that sees it (a venv made with --system-site-packages); import failed: {exc}"
        ) from exc

    class _V:
        pass

    v = _V()
    for name, obj in dict(
        e=enums, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ, Context=Context,
        get_device_list=get_device_list, MR=MR, PD=PD, PyverbsError=PyverbsError, QP=QP,
        QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, RecvWR=RecvWR, SendWR=SendWR,
    ).items():
        setattr(v, name, obj)
    return v


_MTU_ENUM_NAMES = {256: "IBV_MTU_256", 512: "IBV_MTU_512", 1024: "IBV_MTU_1024",
                   2048: "IBV_MTU_2048", 4096: "IBV_MTU_4096"}


# ------------------------------------------------------------------------------ per-QP state
@dataclass
class _Pending:
    """A queued write (cursor = bytes already posted) or FIN, in post order on one lane."""

    op: WriteOp | FinOp
    cursor: int = 0


@dataclass
class _Lane:
    """One stream's RC QP with its notice rings, queue and in-flight bookkeeping."""

    stream: Stream
    qp: Any
    send_mr: Any
    recv_mr: Any
    limit: int  # chunks (+ FINs) in flight at most
    free_slots: list[int]
    queue: deque[_Pending] = field(default_factory=deque)
    # slot -> (request id, bytes of the chunk; -1 for a FIN)
    inflight: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _Session:
    sid: bytes
    send_cq: Any
    recv_cq: Any
    lanes: tuple[_Lane, _Lane]
    connected: bool = False
    probe_after: float = 0.0
    probe_inflight: bool = False
    failed: bool = False
    # weighted mode: data bytes posted per stream since both became backlogged
    share_bytes: list[int] = field(default_factory=lambda: [0, 0])
    # receiver: request id -> the registrations of its announced extents (`expose`)
    exposed: dict[int, list] = field(default_factory=dict)
    peer_requires_checksum: bool = True  # what the peer's local_info says


class VerbsBackend(Backend):
    """pyverbs RDMA backend (see the module docstring). Thread-safe; one progress thread."""

    name = "verbs"
    counts_incoming = True  # every chunk is reported through open_incoming
    # RDMA WRITE lands without the receiver: Session.release() fences with the sender's drain.
    one_sided_writes = True

    def __init__(self, hooks: BackendHooks, host: str, policy: PriorityPolicy,
                 options: dict, checksum: bool = True) -> None:
        self._opts = VerbsOptions.from_dict(options)
        self._v = _import_pyverbs()
        self._hooks = hooks
        self._policy = policy
        self._require_checksum = checksum
        self._lock = threading.Lock()  # every verbs object and all backend state
        self._wake = threading.Event()
        self._sessions: dict[bytes, _Session] = {}
        self._mrs: dict[int, Any] = {}
        self._closed = False
        self._stats = {"chunks_sent": 0, "bytes_sent": 0, "notices_received": 0,
                       "refused": 0, "crc_errors": 0, "probes": 0, "exposed_extents": 0,
                       "peak_inflight_anchor": 0, "peak_inflight_residual": 0}
        v = self._v
        self._device = self._pick_device(self._opts.device)
        try:
            self._ctx = v.Context(name=self._device)
        except v.PyverbsError as exc:
            raise BackendUnavailableError(f"cannot open RDMA device {self._device}: {exc}") from exc
        try:
            self._pd = v.PD(self._ctx)
            port = self._ctx.query_port(_PORT)
            if port.state != v.e.IBV_PORT_ACTIVE:
                raise BackendUnavailableError(
                    f"RDMA device {self._device} port {_PORT} is not active (state {port.state})")
            self._active_mtu = 128 << int(port.active_mtu)
            self._gid_index = self._pick_gid(host, port.gid_tbl_len)
            self._gid = str(self._ctx.query_gid(_PORT, self._gid_index))
        except BaseException:
            self._ctx.close()
            raise
        self._thread = threading.Thread(target=self._progress_loop,
                                        name=f"lynx-verbs-{self._device}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ device selection
    def _pick_device(self, wanted: str | None) -> str:
        try:
            devices = self._v.get_device_list()
        except self._v.PyverbsError as exc:  # no uverbs support in this kernel at all
            raise BackendUnavailableError(f"no RDMA device: {exc}") from exc
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]
        if not names:
            raise BackendUnavailableError("no RDMA device found (ibv_get_device_list is empty)")
        if wanted is None:
            return names[0]
        if wanted not in names:
            raise BackendUnavailableError(f"RDMA device {wanted!r} not found; present: {names}")
        return wanted

    def _pick_gid(self, host: str, table_len: int) -> int:
        if self._opts.gid_index is not None:
            if self._opts.gid_index >= table_len:
                raise ValueError(f"gid_index {self._opts.gid_index} >= GID table size {table_len}")
            return self._opts.gid_index
        want = None
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(host)
            if ip.version == 4 and not ip.is_unspecified and not ip.is_loopback:
                want = ipaddress.IPv6Address("::ffff:" + str(ip))
        first_v4 = None
        for i in range(min(table_len, 256)):
            try:
                gid = ipaddress.IPv6Address(str(self._ctx.query_gid(_PORT, i)))
            except (self._v.PyverbsError, ValueError):
                continue
            if gid.ipv4_mapped is not None:
                if gid == want:
                    return i
                if first_v4 is None:
                    first_v4 = i
        return first_v4 if first_v4 is not None else 0

    # ------------------------------------------------------------------ identity and memory
    def local_info(self) -> dict:
        return {"device": self._device, "gid": self._gid, "gid_index": self._gid_index,
                "mtu": self._active_mtu, "checksum_required": self._require_checksum}

    def register_region(self, region: Region) -> dict:
        if region.length == 0:
            return {}
        # Local access only: the source of RDMA WRITEs. Peers write through `expose`'s per-extent
        # registrations; this one's rkey grants nothing and is never sent.
        try:
            mr = self._v.MR(self._pd, region.length, 0, address=region.addr)
        except self._v.PyverbsError as exc:
            raise TransportError(f"ibv_reg_mr of region {region.id} ({region.length} B) failed: "
                                 f"{exc} (check `ulimit -l`)") from exc
        with self._lock:
            self._mrs[region.id] = mr
        region.backend_handle = mr
        return {}

    def expose(self, session_id: bytes, request_id: int, region: Region, offset: int,
               length: int) -> dict:
        if length == 0:
            return {}  # nothing may be written: no registration, no rkey
        e = self._v.e
        addr = region.addr + offset
        # registered outside _lock: pinning a large extent must not stall the progress thread
        try:
            mr = self._v.MR(self._pd, length, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE,
                            address=addr)
        except self._v.PyverbsError as exc:
            raise TransportError(f"ibv_reg_mr of an extent of region {region.id} "
                                 f"([{offset}, {offset + length})) failed: {exc}") from exc
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.failed:
                mr.close()
                raise TransportError("verbs session is closed")
            s.exposed.setdefault(request_id, []).append(mr)
            self._stats["exposed_extents"] += 1
        return {"addr": addr, "rkey": mr.rkey}

    def withdraw(self, session_id: bytes, request_id: int) -> None:
        with self._lock:
            s = self._sessions.get(session_id)
            for mr in [] if s is None else s.exposed.pop(request_id, []):
                mr.close()
                self._stats["exposed_extents"] -= 1

    def deregister_region(self, region: Region) -> None:
        with self._lock:
            mr = self._mrs.pop(region.id, None)
            if mr is not None:
                mr.close()
        region.backend_handle = None

    # ------------------------------------------------------------------ sessions
    def session_prepare(self, session_id: bytes, initiator: bool, key: bytes) -> dict:
        # `key` is unused: the QP numbers travel in authenticated messages, and an RC QP takes
        # packets only from the QP it was connected to.
        v, e, o = self._v, self._v.e, self._opts
        slots_a, slots_r = o.max_outstanding, o.residual_outstanding
        recv_slots = max(o.max_outstanding, o.residual_outstanding) + 4
        with self._lock:
            if self._closed:
                raise TransportError("verbs backend closed")
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
                    at = v.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=_PORT)
                    at.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                    at.pkey_index = 0
                    qp.to_init(at)
                    send_mr = v.MR(self._pd, slots * _SLOT_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
                    created.append(send_mr)
                    recv_mr = v.MR(self._pd, recv_slots * _SLOT_BYTES, e.IBV_ACCESS_LOCAL_WRITE)
                    created.append(recv_mr)
                    lane = _Lane(stream, qp, send_mr, recv_mr, slots, list(range(slots)))
                    for slot in range(recv_slots):
                        self._post_recv(lane, slot)
                    lanes.append(lane)
            except self._v.PyverbsError as exc:
                for obj in reversed(created):
                    obj.close()
                raise TransportError(f"creating the session's QPs/CQs/notice buffers failed: "
                                     f"{exc}") from exc
            self._sessions[session_id] = _Session(session_id, send_cq, recv_cq,
                                                  (lanes[0], lanes[1]))
        return {"qpn": [lanes[0].qp.qp_num, lanes[1].qp.qp_num]}

    def session_connect(self, session_id: bytes, remote_info: dict, remote_prepare: dict,
                        initiator: bool, timeout: float) -> None:
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
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                raise TransportError("verbs session not prepared (or closed)")
            s.peer_requires_checksum = remote_info.get("checksum_required") is not False
            for lane, rqpn in zip(s.lanes, qpns, strict=True):
                anchor = lane.stream is Stream.ANCHOR
                at = v.QPAttr(qp_state=e.IBV_QPS_RTR, port_num=_PORT)
                at.path_mtu = mtu_enum
                at.dest_qp_num = rqpn
                at.rq_psn = 0
                at.max_dest_rd_atomic = 1
                at.min_rnr_timer = 12
                gr = v.GlobalRoute(dgid=dgid, sgid_index=self._gid_index, hop_limit=64,
                                   traffic_class=o.anchor_tc if anchor else o.residual_tc)
                at.ah_attr = v.AHAttr(gr=gr, is_global=1, port_num=_PORT,
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
            # The Endpoint exchanges READY after both sides return from here; probing before the
            # peer reached RTR would fail the session, so wait a grace period first.
            s.probe_after = time.monotonic() + max(2.0, o.keepalive_s)
        self._wake.set()

    def post_write(self, op: WriteOp) -> None:
        if op.length and (op.dst_extent is None or type(op.dst_info.get("rkey")) is not int
                          or type(op.dst_info.get("addr")) is not int):
            self._hooks.send_failed(op.session_id, op.request_id, op.stream,
                                    FailureReason.LOCAL_ERROR,
                                    f"the peer published no target for region {op.dst_region_id}")
            return
        self._enqueue(op.session_id, op.stream, _Pending(op))

    def post_fin(self, op: FinOp) -> None:
        self._enqueue(op.session_id, op.stream, _Pending(op))

    def _enqueue(self, sid: bytes, stream: Stream, item: _Pending) -> None:
        with self._lock:
            s = self._sessions.get(sid)
            if s is not None and not s.failed:
                s.lanes[int(stream)].queue.append(item)
                self._wake.set()
                return
        self._hooks.send_failed(sid, item.op.request_id, stream, FailureReason.CLOSED,
                                "verbs session is closed")

    def drain(self, session_id: bytes, request_id: int, timeout: float,
              stream: Stream | None = None) -> bool:
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                s = self._sessions.get(session_id)
                # A failed QP is in the error state: the NIC reads no more source bytes.
                if s is None or s.failed:
                    return True
                lanes = s.lanes if stream is None else (s.lanes[int(stream)],)
                for lane in lanes:
                    lane.queue = deque(p for p in lane.queue if p.op.request_id != request_id)
                busy = any(rid == request_id for lane in lanes
                           for rid, _ in lane.inflight.values())
            if not busy:
                return True
            if time.monotonic() >= end:
                return False
            self._wake.set()
            time.sleep(0.001)

    def session_close(self, session_id: bytes) -> None:
        with self._lock:
            s = self._sessions.pop(session_id, None)
            if s is not None:
                self._destroy_session(s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._thread.join(5.0)
        with self._lock:
            for s in list(self._sessions.values()):
                self._destroy_session(s)
            self._sessions.clear()
            for mr in self._mrs.values():
                mr.close()
            self._mrs.clear()
            self._pd.close()
            self._ctx.close()

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._stats)
            out.update(device=self._device, gid_index=self._gid_index, sessions=len(self._sessions),
                       regions=len(self._mrs))
        return out

    def sessions(self):
        with self._lock:
            return iter(list(self._sessions))

    # ------------------------------------------------------------------ verbs helpers
    def _destroy_session(self, s: _Session) -> None:
        """Close QPs first (flushes their WRs), then the exposed extents, rings and CQs. Caller
        holds _lock."""
        s.failed = True
        for lane in s.lanes:
            lane.qp.close()
        for mrs in s.exposed.values():
            for mr in mrs:
                mr.close()
                self._stats["exposed_extents"] -= 1
        s.exposed.clear()
        for lane in s.lanes:
            lane.send_mr.close()
            lane.recv_mr.close()
        s.send_cq.close()
        s.recv_cq.close()

    def _post_recv(self, lane: _Lane, slot: int) -> None:
        v = self._v
        sge = v.SGE(lane.recv_mr.buf + slot * _SLOT_BYTES, _SLOT_BYTES, lane.recv_mr.lkey)
        lane.qp.post_recv(v.RecvWR(wr_id=_wr_id(_WR_RECV, int(lane.stream), slot), num_sge=1,
                                   sg=[sge]))

    def _post_notice(self, lane: _Lane, slot: int, payload: bytes) -> None:
        v, e = self._v, self._v.e
        lane.send_mr.write(payload, len(payload), slot * _SLOT_BYTES)
        sge = v.SGE(lane.send_mr.buf + slot * _SLOT_BYTES, len(payload), lane.send_mr.lkey)
        lane.qp.post_send(v.SendWR(wr_id=_wr_id(_WR_NOTICE, int(lane.stream), slot),
                                   opcode=e.IBV_WR_SEND, num_sge=1, sg=[sge],
                                   send_flags=e.IBV_SEND_SIGNALED))

    def _post_chunk(self, s: _Session, lane: _Lane, op: WriteOp, cursor: int, n: int,
                    slot: int) -> None:
        """RDMA WRITE of op's bytes [cursor, cursor + n) followed by its DATA notice."""
        v, e = self._v, self._v.e
        mr = self._mrs.get(op.src.id)
        if mr is None:
            raise TransportError(f"source region {op.src.id} is not registered with verbs")
        src_addr = op.src.addr + op.src_offset + cursor
        crc = (zlib.crc32(op.src.slice(op.src_offset + cursor, n))
               if op.checksum or s.peer_requires_checksum else None)
        wr = v.SendWR(wr_id=_wr_id(_WR_WRITE, int(lane.stream), slot),
                      opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[v.SGE(src_addr, n, mr.lkey)])
        # the target registration starts at the extent's offset (see `expose`)
        wr.set_wr_rdma(op.dst_info["rkey"],
                       op.dst_info["addr"] + op.dst_offset - op.dst_extent.offset + cursor)
        lane.qp.post_send(wr)
        self._post_notice(lane, slot, pack_data_notice(
            op.stream, op.request_id, op.dst_region_id, op.dst_offset + cursor, n, crc))

    def _post_probe(self, s: _Session) -> None:
        v, e = self._v, self._v.e
        lane = s.lanes[0]
        # Zero-length RDMA WRITE: acknowledged by the peer's NIC, touches no memory, needs no rkey.
        wr = v.SendWR(wr_id=_wr_id(_WR_PROBE, 0, 0), opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                      sg=[v.SGE(lane.recv_mr.buf, 0, lane.recv_mr.lkey)],
                      send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(0, 0)
        lane.qp.post_send(wr)
        s.probe_inflight = True
        self._stats["probes"] += 1

    # ------------------------------------------------------------------ progress thread
    def _progress_loop(self) -> None:
        idle_spins = 0
        while True:
            events: list[tuple] = []
            with self._lock:
                if self._closed:
                    return
                busy = False
                for s in list(self._sessions.values()):
                    if s.failed or not s.connected:
                        continue
                    try:
                        self._poll_session(s, events)
                        if not s.failed:
                            self._schedule(s)
                            self._maybe_probe(s)
                    except Exception as exc:  # a verbs call failed: this session is unusable
                        log.exception("verbs session %s failed", s.sid.hex()[:8])
                        s.failed = True
                        events.append(("lost", s.sid, FailureReason.LOCAL_ERROR,
                                       f"verbs error: {exc}"))
                    busy = busy or s.probe_inflight or any(
                        lane.inflight or lane.queue for lane in s.lanes)
            self._fire(events)
            if events:
                idle_spins = 0
            elif busy:
                # Completions are polled (pyverbs exposes no pollable completion channel fd);
                # back off from spinning to short sleeps so two processes share a small box.
                idle_spins += 1
                time.sleep(0 if idle_spins < 50 else 0.0002)
            else:
                self._wake.wait(0.05)
                self._wake.clear()

    def _fire(self, events: list[tuple]) -> None:
        """Run hook callbacks outside _lock (hooks may call back into drain/session_close)."""
        h = self._hooks
        for ev in events:
            try:
                kind = ev[0]
                if kind == "sent":
                    h.sent(*ev[1:])
                elif kind == "fin":
                    h.incoming_fin(*ev[1:])
                elif kind == "data":
                    self._land(*ev[1:])
                elif kind == "send_failed":
                    h.send_failed(*ev[1:])
                elif kind == "lost":
                    h.session_lost(*ev[1:])
            except Exception:
                log.exception("verbs hook %s failed", ev[0])

    def _land(self, sid: bytes, stream: Stream, request_id: int, region_id: int, offset: int,
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

    def _poll_session(self, s: _Session, events: list[tuple]) -> None:
        e = self._v.e
        n, wcs = s.send_cq.poll(num_entries=32)
        for wc in wcs[:n]:
            kind, lane_i, slot = wc.wr_id >> 62, (wc.wr_id >> 32) & 3, wc.wr_id & 0xFFFFFFFF
            if kind == _WR_PROBE:
                s.probe_inflight = False
                s.probe_after = time.monotonic() + self._opts.keepalive_s
            if wc.status != e.IBV_WC_SUCCESS:
                self._fail_session(s, events, f"work request failed on the "
                                   f"{Stream(lane_i).name} QP: wc status {wc.status} "
                                   f"({_wc_status_name(e, wc.status)})")
                return
            if kind == _WR_NOTICE:
                lane = s.lanes[lane_i]
                rid, nbytes = lane.inflight.pop(slot)
                lane.free_slots.append(slot)
                if nbytes >= 0:
                    self._stats["chunks_sent"] += 1
                    self._stats["bytes_sent"] += nbytes
                    events.append(("sent", s.sid, rid, lane.stream, nbytes))
        n, wcs = s.recv_cq.poll(num_entries=32)
        for wc in wcs[:n]:
            lane_i, slot = (wc.wr_id >> 32) & 3, wc.wr_id & 0xFFFFFFFF
            if wc.status != e.IBV_WC_SUCCESS:
                self._fail_session(s, events, f"receive failed on the {Stream(lane_i).name} QP: "
                                   f"wc status {wc.status} ({_wc_status_name(e, wc.status)})")
                return
            lane = s.lanes[lane_i]
            raw = lane.recv_mr.read(wc.byte_len, slot * _SLOT_BYTES)
            self._post_recv(lane, slot)
            self._stats["notices_received"] += 1
            self._parse_notice(s, lane, raw, events)
            s.probe_after = time.monotonic() + self._opts.keepalive_s

    def _parse_notice(self, s: _Session, lane: _Lane, raw: bytes, events: list[tuple]) -> None:
        try:
            n = parse_notice(raw, lane.stream)
        except NoticeError as exc:
            self._fail_session(s, events, str(exc), FailureReason.CORRUPTION)
            return
        if n.kind == _DATA:
            events.append(("data", s.sid, lane.stream, n.request_id, n.region_id, n.offset,
                           n.length, n.has_crc, n.crc))
        else:
            events.append(("fin", s.sid, n.request_id, lane.stream, n.length, n.aux))

    def _fail_session(self, s: _Session, events: list[tuple], detail: str,
                      reason: FailureReason = FailureReason.PEER_DIED) -> None:
        s.failed = True
        events.append(("lost", s.sid, reason, detail))

    def _schedule(self, s: _Session) -> None:
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

    def _fill(self, s: _Session, lane: _Lane, budget: int | None) -> int:
        """Post queued work on `lane` while slots are free (at most `budget` items); returns the
        data bytes posted."""
        posted = 0
        chunk = self._policy.chunk_bytes
        while lane.queue and len(lane.inflight) < lane.limit and (budget is None or budget > 0):
            item = lane.queue[0]
            slot = lane.free_slots.pop()
            op = item.op
            if isinstance(op, FinOp):
                self._post_notice(lane, slot,
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

    def _maybe_probe(self, s: _Session) -> None:
        if s.probe_inflight or time.monotonic() < s.probe_after:
            return
        if any(lane.inflight for lane in s.lanes):
            return  # traffic in flight already proves (or disproves) the peer is alive
        self._post_probe(s)


def _wc_status_name(e: Any, status: int) -> str:
    """ibv_wc_status name (pyverbs 44 has no status-to-string helper)."""
    for name in dir(e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") and getattr(e, name) == status:
            return name
    return "IBV_WC_SUCCESS" if status == 0 else "unknown status"
