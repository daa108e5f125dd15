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

`VerbsBackend` (here) owns the device, the memory registrations, the sessions and the progress
thread, and composes the parts, each in its own module: the options (`verbs_options`), the
choice of device and GID (`verbs_device`), the notice format (`verbs_wire`), the QPs and their
exchange with the peer (`verbs_qp`), the send side (`verbs_send`: scheduling and posting) and the
completions and incoming notices (`verbs_recv`).

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
tests/transport/test_verbs_{datapath,faults}.py, in the soft-RoCE guest, checks that on rxe: per-extent
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

import logging
import threading
import time
from collections import deque
from typing import Any

from .backend import Backend, BackendHooks, FinOp, PriorityPolicy, WriteOp
from .memory import Region
from .types import BackendUnavailableError, FailureReason, Stream, TransportError
from .verbs_device import pick_device, pick_gid
from .verbs_options import VerbsOptions
from .verbs_qp import PORT, QpSetup, VerbsSession
from .verbs_recv import VerbsReceiver
from .verbs_send import QueuedOp, VerbsSender

log = logging.getLogger("lynx_transport.verbs")


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
        self._sessions: dict[bytes, VerbsSession] = {}
        self._mrs: dict[int, Any] = {}
        self._closed = False
        self._stats = {"chunks_sent": 0, "bytes_sent": 0, "notices_received": 0,
                       "refused": 0, "crc_errors": 0, "probes": 0, "exposed_extents": 0,
                       "peak_inflight_anchor": 0, "peak_inflight_residual": 0}
        v = self._v
        self._device = pick_device(v, self._opts.device)
        try:
            self._ctx = v.Context(name=self._device)
        except v.PyverbsError as exc:
            raise BackendUnavailableError(f"cannot open RDMA device {self._device}: {exc}") from exc
        try:
            self._pd = v.PD(self._ctx)
            port = self._ctx.query_port(PORT)
            if port.state != v.e.IBV_PORT_ACTIVE:
                raise BackendUnavailableError(
                    f"RDMA device {self._device} port {PORT} is not active (state {port.state})")
            self._active_mtu = 128 << int(port.active_mtu)
            self._gid_index = pick_gid(v, self._ctx, self._opts.gid_index, host, port.gid_tbl_len)
            self._gid = str(self._ctx.query_gid(PORT, self._gid_index))
        except BaseException:
            self._ctx.close()
            raise
        self._qps = QpSetup(v, self._ctx, self._pd, self._opts, self._gid_index, self._active_mtu)
        self._sender = VerbsSender(v, policy, self._opts, self._mrs, self._stats)
        self._receiver = VerbsReceiver(v, hooks, self._opts, self._qps, self._lock, self._stats,
                                       checksum)
        self._thread = threading.Thread(target=self._progress_loop,
                                        name=f"lynx-verbs-{self._device}", daemon=True)
        self._thread.start()

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
        with self._lock:
            if self._closed:
                raise TransportError("verbs backend closed")
            s = self._sessions[session_id] = self._qps.create(session_id)
        return {"qpn": [lane.qp.qp_num for lane in s.lanes]}

    def session_connect(self, session_id: bytes, remote_info: dict, remote_prepare: dict,
                        initiator: bool, timeout: float) -> None:
        peer = self._qps.peer_path(remote_info, remote_prepare)
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                raise TransportError("verbs session not prepared (or closed)")
            s.peer_requires_checksum = remote_info.get("checksum_required") is not False
            self._qps.connect(s, peer)
            # The Endpoint exchanges READY after both sides return from here; probing before the
            # peer reached RTR would fail the session, so wait a grace period first.
            s.probe_after = time.monotonic() + max(2.0, self._opts.keepalive_s)
        self._wake.set()

    def post_write(self, op: WriteOp) -> None:
        if op.length and (op.dst_extent is None or type(op.dst_info.get("rkey")) is not int
                          or type(op.dst_info.get("addr")) is not int):
            self._hooks.send_failed(op.session_id, op.request_id, op.stream,
                                    FailureReason.LOCAL_ERROR,
                                    f"the peer published no target for region {op.dst_region_id}")
            return
        self._enqueue(op.session_id, op.stream, QueuedOp(op))

    def post_fin(self, op: FinOp) -> None:
        self._enqueue(op.session_id, op.stream, QueuedOp(op))

    def _enqueue(self, sid: bytes, stream: Stream, item: QueuedOp) -> None:
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
                self._destroy(s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        self._thread.join(5.0)
        with self._lock:
            for s in list(self._sessions.values()):
                self._destroy(s)
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

    def _destroy(self, s: VerbsSession) -> None:
        """Caller holds _lock."""
        self._stats["exposed_extents"] -= QpSetup.destroy(s)

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
                        self._receiver.poll(s, events)
                        if not s.failed:
                            self._sender.schedule(s)
                            self._sender.maybe_probe(s)
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
                    self._receiver.land(*ev[1:])
                elif kind == "send_failed":
                    h.send_failed(*ev[1:])
                elif kind == "lost":
                    h.session_lost(*ev[1:])
            except Exception:
                log.exception("verbs hook %s failed", ev[0])
