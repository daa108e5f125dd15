"""A software stand-in for the parts of pyverbs that `lynx_transport.verbs` uses, so the verbs
backend's logic runs on any host (test_verbs_host.py). It models one RDMA device shared by every
Endpoint of the process, with the checks a real responder makes on an RDMA WRITE: the rkey must
name a live registration of the target QP's protection domain with remote-write access, and the
whole range must lie inside it; a violation fails the sender's work request with a remote access
error and moves both QPs to the error state (their posted receives are flushed), as rxe does.
Delivery is synchronous (inside post_send); a SEND that finds no receive posted waits for one
(RNR retry, as with rnr_retry=7). It is a model, not a device: the guest tests
(test_verbs_datapath.py, test_verbs_faults.py) are the ones against a real verbs stack.

`namespace()` returns what `lynx_transport.verbs._import_pyverbs` returns."""

from __future__ import annotations

import ctypes
import itertools
import threading
from types import SimpleNamespace
from typing import Any

_lock = threading.RLock()
_keys = itertools.count(0x1000)
_qpns = itertools.count(100)
_qps: dict[int, FakeQP] = {}
_mrs: dict[int, FakeMR] = {}  # by rkey (== lkey here)

e = SimpleNamespace(
    IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2, IBV_QPT_RC=2, IBV_QPS_INIT=1,
    IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_ERR=6, IBV_PORT_ACTIVE=4, IBV_WR_RDMA_WRITE=0,
    IBV_WR_SEND=2, IBV_SEND_SIGNALED=2, IBV_WC_SUCCESS=0, IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10, IBV_WC_RETRY_EXC_ERR=12, IBV_QP_AV=1 << 7,
    IBV_MTU_256=1, IBV_MTU_512=2, IBV_MTU_1024=3, IBV_MTU_2048=4, IBV_MTU_4096=5,
)


class PyverbsError(Exception):
    pass


class _Attrs:
    """QPAttr, QPCap, QPInitAttr, AHAttr, GlobalRoute: bags of attributes."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


class Device:
    name = b"fake0"


def get_device_list() -> list[Device]:
    return [Device()]


class Context:
    def __init__(self, name: str):
        self.name = name

    def query_port(self, port: int) -> _Attrs:
        return _Attrs(state=e.IBV_PORT_ACTIVE, active_mtu=e.IBV_MTU_1024, gid_tbl_len=1)

    def query_gid(self, port: int, index: int) -> str:
        return "::ffff:127.0.0.1"

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def close(self) -> None:
        pass


class FakeMR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None):
        self.pd, self.length, self.access = pd, length, access
        self._own = None
        if address is None:
            self._own = (ctypes.c_uint8 * max(length, 1))()
            address = ctypes.addressof(self._own)
        self.buf = address
        with _lock:
            self.lkey = self.rkey = next(_keys)
            _mrs[self.rkey] = self

    def write(self, data: bytes, length: int, offset: int) -> None:
        ctypes.memmove(self.buf + offset, data, length)

    def read(self, length: int, offset: int) -> bytes:
        return ctypes.string_at(self.buf + offset, length)

    def close(self) -> None:
        with _lock:
            _mrs.pop(self.rkey, None)


class CQ:
    def __init__(self, ctx: Context, n: int):
        self.wcs: list[_Attrs] = []

    def poll(self, num_entries: int) -> tuple[int, list[_Attrs]]:
        with _lock:
            out, self.wcs = self.wcs[:num_entries], self.wcs[num_entries:]
        return len(out), out

    def close(self) -> None:
        pass


class SGE:
    def __init__(self, addr: int, length: int, lkey: int):
        self.addr, self.length, self.lkey = addr, length, lkey


class RecvWR:
    def __init__(self, wr_id: int, num_sge: int, sg: list[SGE]):
        self.wr_id, self.sg = wr_id, sg


class SendWR:
    def __init__(self, wr_id: int, opcode: int, num_sge: int, sg: list[SGE], send_flags: int = 0):
        self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg, send_flags
        self.rkey = self.remote_addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class FakeQP:
    def __init__(self, pd: PD, init: _Attrs):
        self.pd, self.scq, self.rcq = pd, init.scq, init.rcq
        self.state = 0
        self.dest = -1
        self.recvs: list[RecvWR] = []
        self.backlog: list[bytes] = []  # SENDs that found no receive posted
        with _lock:
            self.qp_num = next(_qpns)
            _qps[self.qp_num] = self

    def to_init(self, attr: _Attrs) -> None:
        self.state = e.IBV_QPS_INIT

    def to_rtr(self, attr: _Attrs) -> None:
        self.dest, self.state = attr.dest_qp_num, e.IBV_QPS_RTR

    def to_rts(self, attr: _Attrs) -> None:
        self.state = e.IBV_QPS_RTS

    def post_recv(self, wr: RecvWR) -> None:
        with _lock:
            if self.state == e.IBV_QPS_ERR:
                self.rcq.wcs.append(_Attrs(wr_id=wr.wr_id, status=e.IBV_WC_WR_FLUSH_ERR,
                                           byte_len=0))
            elif self.backlog:
                self._deliver(wr, self.backlog.pop(0))
            else:
                self.recvs.append(wr)

    def _deliver(self, wr: RecvWR, data: bytes) -> None:
        ctypes.memmove(wr.sg[0].addr, data, len(data))
        self.rcq.wcs.append(_Attrs(wr_id=wr.wr_id, status=e.IBV_WC_SUCCESS, byte_len=len(data)))

    def _error(self) -> None:
        self.state = e.IBV_QPS_ERR
        for wr in self.recvs:
            self.rcq.wcs.append(_Attrs(wr_id=wr.wr_id, status=e.IBV_WC_WR_FLUSH_ERR, byte_len=0))
        self.recvs.clear()

    def post_send(self, wr: SendWR) -> None:
        with _lock:
            status = self._execute(wr)
            if status != e.IBV_WC_SUCCESS or wr.send_flags & e.IBV_SEND_SIGNALED:
                self.scq.wcs.append(_Attrs(wr_id=wr.wr_id, status=status, byte_len=0))

    def _execute(self, wr: SendWR) -> int:
        if self.state != e.IBV_QPS_RTS:
            return e.IBV_WC_WR_FLUSH_ERR
        peer = _qps.get(self.dest)
        if peer is None or peer.state == e.IBV_QPS_ERR:
            self._error()
            return e.IBV_WC_RETRY_EXC_ERR
        sge = wr.sg[0]
        if wr.opcode == e.IBV_WR_RDMA_WRITE:
            if sge.length == 0:
                return e.IBV_WC_SUCCESS  # a probe: acknowledged, touches nothing
            mr = _mrs.get(wr.rkey)
            if (mr is None or mr.pd is not peer.pd or not mr.access & e.IBV_ACCESS_REMOTE_WRITE
                    or not mr.buf <= wr.remote_addr <= mr.buf + mr.length - sge.length):
                self._error()
                peer._error()
                return e.IBV_WC_REM_ACCESS_ERR
            ctypes.memmove(wr.remote_addr, sge.addr, sge.length)
            return e.IBV_WC_SUCCESS
        data = ctypes.string_at(sge.addr, sge.length)  # SEND
        if peer.recvs:
            peer._deliver(peer.recvs.pop(0), data)
        else:
            peer.backlog.append(data)
        return e.IBV_WC_SUCCESS

    def close(self) -> None:
        with _lock:
            self._error()
            _qps.pop(self.qp_num, None)


def namespace() -> SimpleNamespace:
    return SimpleNamespace(
        e=e, GID=str, AHAttr=_Attrs, GlobalRoute=_Attrs, CQ=CQ, Context=Context,
        get_device_list=get_device_list, MR=FakeMR, PD=PD, PyverbsError=PyverbsError, QP=FakeQP,
        QPAttr=_Attrs, QPCap=_Attrs, QPInitAttr=_Attrs, SGE=SGE, RecvWR=RecvWR, SendWR=SendWR)
