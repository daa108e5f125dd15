"""The `lynx` transfer backend's classes (lynx_sglang.backend) with SGLang's own machinery, in one
process over loopback: real `KVArgs` filled the way SGLang's `PrefillBootstrapQueue._init_kv_manager`
and `DecodePreallocQueue._init_kv_manager` fill them (SGLang's `get_kv_transfer_buf_infos`,
`build_kv_layer_ids`, `setup_state_kv_args`, `MetadataBuffers.get_buf_infos`), real CPU KV pools
(SGLang's `MHATokenToKVPool`, bf16, page size 1), a real `LynxKVBootstrapServer`, a prefill and a
decode `LynxKVManager` (SGLang's ZMQ control plane, the lynx_transport tcp data plane) and one
`LynxKVSender` / `LynxKVReceiver` pair per request. No model, no SGLang server processes.

What stands in for SGLang's scheduler (the smallest honest substitute):
- the scheduler's published config: `RuntimeContext.override_server_args` (SGLang's own test hook)
  with the bootstrap host on loopback, and `get_parallel().override` for the ranks a scheduler
  process writes when it builds its process groups (all 0, single rank; no pipeline group);
- `enable_pd_role_switch=True`: it only makes SGLang's manager threads poll their ZMQ sockets with a
  timeout instead of blocking, so `teardown()` can stop them between tests;
- the bootstrap/prealloc/transfer queues: each test drives the sender and receiver in the order the
  queues do (receiver: `try_ensure_parallel_info`, `init`, `send_metadata`; sender: wait for
  WaitingForInput, `init`, `send`; `failure_exception` on Failed) and writes the request's first
  output token and bootstrap room into the prefill's metadata row, as the prefill's batch result
  processing does;
- `attach_kv_pool`, which the plugin's `_init_kv_manager` hook calls in a real scheduler;
- stopping a manager: LynxKVManager has no teardown of its own threads, so the fixture sets its
  `_stop` event before SGLang's `teardown()`.

Most tests run the managers non-speculative (`--no-lynx-speculate`): a decode room becomes
Success only once the Residual is in the KV pool, and Failed (with its staging freed) when the
transfer cannot finish. The last test checks the speculative contract instead (Success at Anchor
time, the Residual's outcome reported through `residual_outcome`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec
import pytest
import torch

from lynx_kernels import decode, encode
from lynx_sglang.backend.identity import IDENTITY_REQUEST
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.staging import ALIGN as STAGING_ALIGN
from lynx_sglang.config import LynxConfig
from lynx_sglang.names import (
    CONFIG_ENV,
    FAULT_ANCHOR_DELAY_ENV,
    FAULT_ANCHOR_HOLD_LOG,
    FAULT_RESIDUAL_DELAY_ENV,
    FAULT_RESIDUAL_HOLD_LOG,
)
from lynx_transport import Stream

pytestmark = pytest.mark.sglang

LOOPBACK = "127.0.0.1"
LAYERS, HEADS, HEAD_DIM, POOL_TOKENS = 2, 2, 64, 1024
NUM_TOKENS = 300  # two Lynx chunks (256 + 44 tokens), a partial quantization group
AUX_ROWS = 4
# Inside the soft-RoCE guest (scripts/rdma_vm.sh sets LYNX_RDMA_VM and LYNX_RDMA_DEVICE) the tests
# marked `rdma_vm` run the same managers over the `verbs` transport on rxe0 instead of tcp: the
# end-to-end SGLang servers cannot start in the emulated guest within CI time (about 25-45x slower
# Python), so this is where Lynx's KV managers meet real RDMA verbs.
VERBS_DEVICE = os.environ.get("LYNX_RDMA_DEVICE") if os.environ.get("LYNX_RDMA_VM") else None
TRANSPORT = {"transport": "verbs", "ib_device": VERBS_DEVICE} if VERBS_DEVICE else {}
# Small deadlines so a failure path ends in seconds (the guest is far slower); the Residual hold is
# long enough for a test to act between the Anchor and the Residual, short enough to keep the file
# quick.
# transfer_timeout_s covers a 2 s Residual hold plus both streams on a loaded CI box (4 s was
# exceeded there once: the deadline failed the room under test_success_waits_for_the_residual).
TIMEOUTS = ({"connect_timeout_s": 60.0, "transfer_timeout_s": 120.0} if VERBS_DEVICE else
            {"connect_timeout_s": 2.0, "transfer_timeout_s": 10.0})
# In the emulated guest, parsing and applying an Anchor alone takes seconds.
RESIDUAL_HOLD_S = 30.0 if VERBS_DEVICE else 2.0
# A hold the test ends itself (`FaultPlan.release`): only a backstop.
LONG_HOLD_S = 120.0
WAIT_S = 240.0 if VERBS_DEVICE else 20.0


@dataclass
class _SGLang:
    """The SGLang names the tests use, imported once the CPU engine is set up."""

    KVPoll: type
    KVTransferError: type
    DisaggregationMode: type
    # What SGLang's get_kv_class answers for the `lynx` backend.
    KVArgs: type
    Manager: type
    Sender: type
    Receiver: type
    BootstrapServer: type
    MetadataBuffers: type
    MHATokenToKVPool: type
    get_kv_transfer_buf_infos: Callable
    get_pd_kv_layout: Callable
    build_kv_layer_ids: Callable
    setup_state_kv_args: Callable
    get_free_port: Callable
    context: object
    server_args: object


@pytest.fixture(scope="module")
def sgl(sglang_in_process):
    with contextlib.ExitStack() as stack:
        from lynx_sglang import plugin

        # Before importing get_kv_class: the hook patches module attributes, not this frame's.
        plugin.install_backend()
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import KVTransferError
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            build_kv_layer_ids,
            get_kv_class,
            get_kv_transfer_buf_infos,
            get_pd_kv_layout,
            setup_state_kv_args,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.runtime_context import get_context, get_parallel
        from sglang.srt.utils.network import get_free_port

        backend = TransferBackend(plugin.BACKEND_NAME)
        override = get_context().override_server_args(
            host=LOOPBACK, disaggregation_transfer_backend=plugin.BACKEND_NAME,
            enable_pd_role_switch=True)
        # The managers read the flag from the ServerArgs they are given (the published one keeps
        # its raw, unresolved value), so they get a copy with it set.
        server_args = msgspec.structs.replace(override.install(), enable_pd_role_switch=True)
        stack.callback(override.restore)
        stack.enter_context(get_parallel().override(
            attn_tp_rank=0, attn_cp_rank=0, attn_dcp_rank=0, attn_dp_rank=0, pp_group=None))
        yield _SGLang(
            KVPoll=KVPoll, KVTransferError=KVTransferError, DisaggregationMode=DisaggregationMode,
            KVArgs=get_kv_class(backend, KVClassType.KVARGS),
            Manager=get_kv_class(backend, KVClassType.MANAGER),
            Sender=get_kv_class(backend, KVClassType.SENDER),
            Receiver=get_kv_class(backend, KVClassType.RECEIVER),
            BootstrapServer=get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER),
            MetadataBuffers=MetadataBuffers, MHATokenToKVPool=MHATokenToKVPool,
            get_kv_transfer_buf_infos=get_kv_transfer_buf_infos,
            get_pd_kv_layout=get_pd_kv_layout, build_kv_layer_ids=build_kv_layer_ids,
            setup_state_kv_args=setup_state_kv_args, get_free_port=get_free_port,
            context=get_context(), server_args=server_args,
        )


@dataclass
class Side:
    """One server's KV manager with the KV pool and metadata buffers it was built from."""

    mgr: object
    pool: object
    meta: object


@dataclass
class PD:
    prefill: Side
    decode: Side
    bootstrap_addr: str


def _build_side(sgl: _SGLang, mode) -> Side:
    """What `_init_kv_manager` of SGLang's prefill / decode queue does, for an MHA pool on CPU."""
    pool = sgl.MHATokenToKVPool(size=POOL_TOKENS, page_size=1, dtype=torch.bfloat16,
                                head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False)
    meta = sgl.MetadataBuffers(AUX_ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16,
                               max_sampling_mask_tokens=16)
    kv_args = sgl.KVArgs()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "auto"
    kv_args.kv_layout = sgl.get_pd_kv_layout(pool)
    kv_args.prefill_start_layer = pool.start_layer
    kv_args.prefill_end_layer = pool.end_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = (
        sgl.get_kv_transfer_buf_infos(pool))
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = sgl.build_kv_layer_ids(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0,
        num_hidden_layers=LAYERS)
    kv_args.kv_head_num = HEADS
    kv_args.total_kv_head_num = HEADS
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    sgl.setup_state_kv_args(kv_args, pool, None, LAYERS, req_to_token_pool=None)
    mgr = sgl.Manager(kv_args, mode, sgl.server_args, False)
    mgr.attach_kv_pool(pool)
    return Side(mgr, pool, meta)


def _stop(mgr) -> None:
    # LynxKVManager's own threads watch `_stop`; SGLang's teardown() stops the rest, closes the
    # ZMQ sockets and (deregister_buffer_to_engine) the transport endpoint.
    mgr._stop.set()
    mgr.teardown()


@pytest.fixture
def make_pd(sgl, monkeypatch):
    """make_pd(prefill=LynxConfig, decode=LynxConfig, residual_hold_s=0, anchor_hold_s=0) -> PD,
    on a fresh bootstrap server; everything is stopped at the end of the test."""
    started: list = []

    def _make(prefill: LynxConfig, decode: LynxConfig | None = None,
              residual_hold_s: float = 0.0, anchor_hold_s: float = 0.0) -> PD:
        port = sgl.get_free_port()
        sgl.context.override("test_conn_loopback", disaggregation_bootstrap_port=port)
        server = sgl.BootstrapServer(host=LOOPBACK, port=port)
        started.append(server.close)
        # SGLang's managers bind to, and announce, get_local_ip_auto().
        monkeypatch.setenv("SGLANG_HOST_IP", LOOPBACK)
        sides = []
        for mode, cfg, holds in (
                (sgl.DisaggregationMode.PREFILL, prefill, (residual_hold_s, anchor_hold_s)),
                (sgl.DisaggregationMode.DECODE, decode or prefill, (0.0, 0.0))):
            monkeypatch.setenv(CONFIG_ENV, json.dumps(cfg.flat()))
            monkeypatch.setenv(FAULT_RESIDUAL_DELAY_ENV, str(holds[0]))
            monkeypatch.setenv(FAULT_ANCHOR_DELAY_ENV, str(holds[1]))
            side = _build_side(sgl, mode)
            started.append(lambda m=side.mgr: _stop(m))
            sides.append(side)
        return PD(sides[0], sides[1], f"{LOOPBACK}:{port}")

    yield _make
    for stop in reversed(started):
        stop()


# ---- helpers --------------------------------------------------------------------------------


def _cfg(**kw) -> LynxConfig:
    # By default the non-speculative contract (`--no-lynx-speculate`): Success only with the
    # Residual in the pool, failures reported to SGLang as Failed.
    return LynxConfig.build(**{"staging_mib": 4, "speculate": False, **TIMEOUTS, **TRANSPORT, **kw})


def _wait(what: str, cond: Callable[[], object], timeout: float = WAIT_S):
    """Poll `cond` until it is truthy; fail (not hang) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(0.005)


@dataclass
class Request:
    room: int
    sender: object
    receiver: object
    prefill_slots: torch.Tensor
    decode_slots: torch.Tensor
    prefill_aux: int
    decode_aux: int


def _open_request(sgl: _SGLang, pd: PD, room: int, seed: int, beside: tuple[Request, ...] = (),
                  tokens: int = NUM_TOKENS) -> tuple[Request, torch.Generator]:
    """A request through the conn classes up to the prefill's `send`, in the order SGLang's
    prefill bootstrap queue and decode prealloc queue drive them: its slots on both sides (slot 0
    is SGLang's padding slot; none of `beside`'s, requests in flight at the same time),
    SGLang's metadata row on the prefill, the decode's KV indices at the prefill. Returns the
    request and the generator of its random data."""
    req, g = _request_metadata(sgl, pd, room, seed, beside, tokens)
    _wait("the prefill to get the decode's KV indices",
          lambda: req.sender.poll() == sgl.KVPoll.WaitingForInput)
    req.sender.init(tokens, req.prefill_aux)
    return req, g


def _request_metadata(sgl: _SGLang, pd: PD, room: int, seed: int, beside: tuple[Request, ...] = (),
                      tokens: int = NUM_TOKENS) -> tuple[Request, torch.Generator]:
    """`_open_request` up to the decode's `send_metadata` (which the receiver may hold back)."""
    g = torch.Generator().manual_seed(seed)

    def slots(taken: list[torch.Tensor]) -> torch.Tensor:
        free = torch.randperm(POOL_TOKENS, generator=g) + 1
        return (free[~torch.isin(free, torch.cat(taken))] if taken else free)[:tokens]

    prefill_slots = slots([b.prefill_slots for b in beside])
    decode_slots = slots([b.decode_slots for b in beside])
    assert len(prefill_slots) == len(decode_slots) == tokens
    prefill_aux, decode_aux = seed % AUX_ROWS, (seed + 1) % AUX_ROWS
    meta = pd.prefill.meta
    meta.output_ids[prefill_aux].copy_(torch.randint(1, 50000, (16,), generator=g))
    meta.bootstrap_room[prefill_aux, 0] = room
    sender = sgl.Sender(mgr=pd.prefill.mgr, bootstrap_addr=pd.bootstrap_addr, bootstrap_room=room)
    receiver = sgl.Receiver(mgr=pd.decode.mgr, bootstrap_addr=pd.bootstrap_addr,
                            bootstrap_room=room)
    assert pd.decode.mgr.try_ensure_parallel_info(pd.bootstrap_addr)
    receiver.init(0)
    # SGLang's KV indices are int32 (req_to_token); the metadata message carries their raw bytes.
    receiver.send_metadata(decode_slots.to(torch.int32).numpy(), decode_aux)
    return (Request(room, sender, receiver, prefill_slots, decode_slots, prefill_aux, decode_aux),
            g)


def _forward_layer(pd: PD, req: Request, layer: int, g: torch.Generator) -> None:
    """What the prefill forward writes of one layer: random K and V in the request's slots."""
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        x = torch.randn(len(req.prefill_slots), HEADS, HEAD_DIM, generator=g) * (layer + 1)
        buffers[layer][req.prefill_slots] = x.to(torch.bfloat16)


def _start_request(sgl: _SGLang, pd: PD, room: int, seed: int, beside: tuple[Request, ...] = (),
                   tokens: int = NUM_TOKENS) -> Request:
    """A request whose prefill KV is all there when SGLang sends it (after its forward)."""
    req, g = _open_request(sgl, pd, room, seed, beside, tokens)
    _forward_and_send(pd, req, g)
    return req


def _forward_and_send(pd: PD, req: Request, g: torch.Generator) -> None:
    for layer in range(LAYERS):
        _forward_layer(pd, req, layer, g)
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                    num_kv_tokens=len(req.prefill_slots))


def _poll_until_done(sgl: _SGLang, party) -> int:
    done = (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    # A 1-tuple: KVPoll.Failed is 0, which _wait would take for "not yet".
    return _wait(f"{type(party).__name__} to reach Success or Failed",
                 lambda: (s,) if (s := party.poll()) in done else None)[0]


def _failure_message(sgl: _SGLang, party) -> str:
    """What SGLang's queues do with a Failed room: failure_exception() (clears it, raises)."""
    with pytest.raises(sgl.KVTransferError) as info:
        party.failure_exception()
    return str(info.value)


def _expected(pd: PD, req: Request, stage: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(decode slots now, codec reconstruction `stage` of the prefill slots) per layer and kind."""
    spec = pd.decode.mgr.lynx.codec
    out = []
    for kind, src, dst in (("k", pd.prefill.pool.k_buffer, pd.decode.pool.k_buffer),
                           ("v", pd.prefill.pool.v_buffer, pd.decode.pool.v_buffer)):
        for layer in range(LAYERS):
            x = src[layer][req.prefill_slots]
            out.append((dst[layer][req.decode_slots], decode(encode(x, spec, kind, layer=layer),
                                                             stage)))
    return out


def _prefill_staging_free(pd: PD) -> bool:
    return pd.prefill.mgr.staging.free_bytes() == pd.prefill.mgr.staging.nbytes


def _release_holds_and_expect_full_kv(sgl: _SGLang, pd: PD, req: Request) -> None:
    """End the prefill's fault-injection hold early: the room then succeeds with its exact KV
    in the decode's pool, and the prefill gives its staging back."""
    pd.prefill.mgr.sender.faults.release()
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, req.receiver)
    assert _holds(pd, req, "full")
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))


def _let_residual_go_after_release(pd: PD, req: Request) -> None:
    """End the prefill's Residual hold (`FaultPlan.release`) once the decode's release of
    `req` has reached it over the control plane: a Residual let go before that is written and
    reported Success (the decode drops its bytes), which is right, but not what the test checks."""
    sender = pd.prefill.mgr.sender
    _wait("the prefill to hear of the release", lambda: any(
        req.room in s._peer_released for s in list(sender.sessions._sessions.values())))
    sender.faults.release()


def _holds(pd: PD, req: Request, stage: str) -> bool:
    return all(torch.equal(got, want) for got, want in _expected(pd, req, stage))


def _anchor_in(pd: PD, req: Request) -> bool:
    """The decode has validated the room's whole Anchor and seen its stream end (every layer's
    bytes can land before the end does: a fault injected between the two is not "after the
    Anchor"). Non-speculative rooms never write the Anchor into the pool (nothing would read it
    before the Residual), so the pool cannot tell."""
    room = pd.decode.mgr.applier.rooms.get(req.room)
    return (room is not None and room.progress.anchor_layers_landed == LAYERS
            and room.t_anchor_landed is not None)


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.rdma_vm
@pytest.mark.parametrize("target", ["exact", "int8"])
def test_one_request(sgl, make_pd, target):
    pd = make_pd(_cfg(target=target))
    untouched = torch.ones(POOL_TOKENS + 1, dtype=torch.bool)  # the pool has a padding slot 0
    before = [t.clone() for t in pd.decode.pool.k_buffer + pd.decode.pool.v_buffer]
    req = _start_request(sgl, pd, room=1001, seed=1)
    untouched[req.decode_slots] = False

    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    # SGLang's transfer metric (sglang:kv_transfer_total_mb) counts the bytes Lynx sent, not
    # the pool bytes of the slots; read once.
    plan = StreamPlan.build(pd.prefill.mgr.lynx.codec, pd.prefill.mgr.pool.shape, NUM_TOKENS,
                            pd.prefill.mgr.lynx.chunk_tokens)
    sent = req.sender.get_transfer_metric().transfer_total_bytes
    pool_bytes = NUM_TOKENS * LAYERS * 2 * HEADS * HEAD_DIM * pd.prefill.pool.k_buffer[0].element_size()
    if target == "int8":
        assert sent == plan.anchor_bytes + plan.residual_bytes
    else:
        assert plan.anchor_bytes < sent <= plan.anchor_bytes + plan.residual_bytes
    assert sent != pool_bytes
    assert req.sender.get_transfer_metric().transfer_total_bytes == pool_bytes
    if target == "exact":
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                src = getattr(pd.prefill.pool, kind)[layer][req.prefill_slots]
                dst = getattr(pd.decode.pool, kind)[layer][req.decode_slots]
                assert torch.equal(dst, src), (kind, layer)
    else:
        for got, want in _expected(pd, req, "full"):
            assert torch.equal(got, want)
        # INT8 is lossy: the test would pass vacuously if the pool held the source values.
        assert not torch.equal(pd.decode.pool.k_buffer[0][req.decode_slots],
                               pd.prefill.pool.k_buffer[0][req.prefill_slots])
    after = pd.decode.pool.k_buffer + pd.decode.pool.v_buffer
    for t_before, t_after in zip(before, after, strict=True):
        assert torch.equal(t_after[untouched], t_before[untouched])
    # SGLang's metadata row (first output token, bootstrap room, ...) arrived with the KV.
    src, dst = pd.prefill.meta, pd.decode.meta
    for name in ("output_ids", "cached_tokens", "output_token_logprobs_val", "bootstrap_room"):
        assert torch.equal(getattr(dst, name)[req.decode_aux],
                           getattr(src, name)[req.prefill_aux]), name
    assert int(dst.bootstrap_room[req.decode_aux, 0]) == req.room
    # Both staging ranges are given back once the room is done.
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


def test_a_late_end_of_residual_still_succeeds(sgl, make_pd, monkeypatch):
    """Every Residual byte may land before the prefill marks the stream finished (its thread
    descheduled under load). The decode must wait for that end before it lets the room go: it
    used to release the announcement at once, and the prefill's finish a moment later found no
    live announcement and failed a request whose KV was complete (2 of 64 concurrent requests in
    `lynx-sglang load`)."""
    from lynx_transport.session import Session

    finish = Session.finish

    def late_residual_end(self, request_id, stream, aux=b""):
        if Stream(stream) is Stream.RESIDUAL:
            time.sleep(0.5)
        return finish(self, request_id, stream, aux)

    monkeypatch.setattr(Session, "finish", late_residual_end)
    pd = make_pd(_cfg(target="exact"))
    req = _start_request(sgl, pd, room=1011, seed=11)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, req.receiver)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for got, src in _expected(pd, req, "full"):
        assert torch.equal(got, src)


@pytest.mark.rdma_vm
def test_success_waits_for_the_residual(sgl, make_pd):
    """The prefill's Success reaching the decode early (here: sent by the test over SGLang's
    control plane while the prefill holds the Residual back) must not make the room Success
    before the Residual is in the KV pool."""
    pd = make_pd(_cfg(target="exact"), residual_hold_s=RESIDUAL_HOLD_S)
    req = _start_request(sgl, pd, room=2002, seed=2)
    _wait("the whole Anchor at the decode", lambda: _anchor_in(pd, req))
    assert req.receiver.poll() != sgl.KVPoll.Success
    assert not _holds(pd, req, "anchor")  # not speculating: the Anchor is never written

    prefill = pd.prefill.mgr
    targets = [(i.endpoint, i.dst_port) for i in prefill.transfer_infos[req.room].values()]
    prefill.send_kv_status_message(targets=targets, bootstrap_room=req.room,
                                   status=sgl.KVPoll.Success)
    _wait("the decode to take the prefill's Success",
          lambda: pd.decode.mgr.prefill_response_tracker.get(req.room))
    held = 0
    while True:
        status = req.receiver.poll()  # before the pool: Success must imply full precision
        full = _holds(pd, req, "full")
        if status == sgl.KVPoll.Success:
            assert full, "Success reported while the decode pool holds Anchor-precision KV"
            break
        assert status != sgl.KVPoll.Failed, _failure_message(sgl, req.receiver)
        held += not full
        time.sleep(0.005)
    assert held, "the Residual was applied before the test could poll; raise RESIDUAL_HOLD_S"
    for got, src in _expected(pd, req, "full"):
        assert torch.equal(got, src)


@pytest.mark.parametrize("field, prefill_value, decode_value, flag", [
    ("target", "exact", "int8", "--lynx-target"),  # different stream sizes
    ("rotate", True, False, "--lynx-rotate"),  # same sizes: only the settings tell
])
def test_codec_mismatch_fails_both_sides_at_connect(sgl, make_pd, field, prefill_value,
                                                    decode_value, flag):
    """The prefill sends its wire settings when it opens the session; the decode refuses the
    session once, naming the flag, and both sides' requests fail with that reason."""
    pd = make_pd(_cfg(**{field: prefill_value}), _cfg(**{field: decode_value}))
    req = _start_request(sgl, pd, room=3003, seed=3)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    expect = f"{flag}: prefill {prefill_value!r}, decode {decode_value!r}"
    assert expect in _failure_message(sgl, req.sender)
    decode_msg = _failure_message(sgl, req.receiver)
    assert expect in decode_msg, decode_msg
    # failure_exception() cleared the receiver: nothing of the room is left in decode staging.
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert not _holds(pd, req, "full")


@pytest.fixture(scope="module")
def tls_flags(tmp_path_factory) -> dict:
    from lynx_tools.tls_certs import make_certs

    files = make_certs(tmp_path_factory.mktemp("tls"), [LOOPBACK])
    return {"tls_cert": str(files.cert_file), "tls_key": str(files.key_file),
            "tls_ca": str(files.ca_file)}


def test_a_request_over_tls_arrives_bit_exact(sgl, make_pd, tls_flags):
    pd = make_pd(_cfg(target="exact", **tls_flags))
    req = _start_request(sgl, pd, room=3101, seed=31)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
    backend = pd.decode.mgr.endpoint.backend
    assert backend.local_info()["tls"] is True
    assert all(len(ts.socks) == 4 for ts in backend._sessions.values())


def test_tls_on_one_side_only_fails_both_sides_naming_the_flags(sgl, make_pd, tls_flags):
    pd = make_pd(_cfg(), _cfg(**tls_flags))
    req = _start_request(sgl, pd, room=3102, seed=32)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    for party in (req.sender, req.receiver):
        message = _failure_message(sgl, party)
        assert "TLS" in message and "--lynx-tls-cert" in message, message
    # failure_exception() cleared the receiver: nothing of the room is left in decode staging.
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


def test_abort_mid_transfer_frees_staging(sgl, make_pd):
    pd = make_pd(_cfg(target="exact", transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    decode = pd.decode.mgr
    req = _start_request(sgl, pd, room=4004, seed=4)
    _wait("the whole Anchor at the decode", lambda: _anchor_in(pd, req))
    assert decode.staging.free_bytes() < decode.staging.nbytes
    req.receiver.abort()
    assert req.receiver.poll() == sgl.KVPoll.Failed
    assert decode.staging.free_bytes() == decode.staging.nbytes
    # The prefill sends the Residual of the now unknown room once let go (every later room's
    # too: the release stays set): it fails the room, and nothing lands in the decode pool.
    _let_residual_go_after_release(pd, req)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    assert not _holds(pd, req, "full")
    assert decode.staging.free_bytes() == decode.staging.nbytes
    # The session between the two survives an aborted room: the next request goes through.
    nxt = _start_request(sgl, pd, room=4005, seed=5)
    assert _poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
    assert _holds(pd, nxt, "full")


def test_a_room_the_decode_timed_out_before_its_residual_frees_the_prefill(sgl, make_pd):
    """The decode's transfer deadline fails the room while the prefill still holds the Residual
    back (here the fault-injection hold; in service a Residual encode slower than the deadline):
    the prefill's late Residual is refused at once and the room's staging comes back. Before, its
    Residual stream stayed pending with nobody to acknowledge it, and the staging was held until
    the session ended."""
    hold = 3.0
    pd = make_pd(_cfg(target="exact", transfer_timeout_s=1.0), residual_hold_s=hold)
    req = _start_request(sgl, pd, room=4024, seed=24)
    t0 = time.monotonic()
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    assert "receiver deadline passed" in _failure_message(sgl, req.receiver)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd),
          timeout=hold + 10.0)
    assert time.monotonic() - t0 < hold + 10.0
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_in_flight"] == 0
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


def test_prefill_staging_freed_after_decode_abort(sgl, make_pd):
    pd = make_pd(_cfg(target="exact", transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    req = _start_request(sgl, pd, room=4014, seed=4)
    _wait("the whole Anchor at the decode", lambda: _anchor_in(pd, req))
    req.receiver.abort()
    _let_residual_go_after_release(pd, req)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    # The reaper runs every 50 ms: a few seconds is a generous bound for a freed range.
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd), timeout=5.0)


def _fill_decode_staging(sgl: _SGLang, pd: PD,
                         first_room: int) -> list[tuple[Request, torch.Generator]]:
    """As many rooms as the decode's staging holds at once, opened up to the prefill's `send`
    (their KV indices at the prefill, their ranges held), none sent yet."""
    staging = pd.decode.mgr.staging
    plan = StreamPlan.build(pd.decode.mgr.lynx.codec, pd.decode.mgr.pool.shape, NUM_TOKENS,
                            pd.decode.mgr.lynx.chunk_tokens)
    fit = staging.nbytes // (-(-plan.staging_bytes // STAGING_ALIGN) * STAGING_ALIGN)
    # One more room must still find free KV slots on both sides.
    assert fit >= 1 and (fit + 1) * NUM_TOKENS < POOL_TOKENS, fit
    holders: list[tuple[Request, torch.Generator]] = []
    for i in range(fit):
        holders.append(_open_request(sgl, pd, room=first_room + i, seed=first_room + i,
                                     beside=tuple(r for r, _ in holders)))
    assert staging.try_allocate(plan.staging_bytes) is None  # full for one more room
    return holders


def _queued(pd: PD) -> int:
    return pd.decode.mgr.applier.tracked()["decode_rooms_awaiting_staging"]


def test_a_room_that_finds_decode_staging_full_waits_and_succeeds(sgl, make_pd):
    """Concurrency beyond the decode's staging queues a room instead of failing it: its KV indices
    are held back from the prefill until a range comes free (so the prefill does not start it),
    then it goes through like any other, exactly."""
    pd = make_pd(_cfg(target="exact", staging_mib=1))
    holders = _fill_decode_staging(sgl, pd, first_room=8100)
    late, g = _request_metadata(sgl, pd, room=8190, seed=90, beside=tuple(r for r, _ in holders))
    assert _queued(pd) == 1
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        assert late.receiver.poll() == sgl.KVPoll.WaitingForInput
        assert late.sender.poll() == sgl.KVPoll.Bootstrapping  # the prefill has no indices yet
        time.sleep(0.02)
    for req, rg in holders:
        _forward_and_send(pd, req, rg)
    for req, _ in holders:
        assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    # The receiver's poll (SGLang's transfer queue polls it every step) sends the held indices.
    _wait("the prefill to get the queued room's KV indices",
          lambda: (late.receiver.poll(), late.sender.poll())[1] == sgl.KVPoll.WaitingForInput)
    assert _queued(pd) == 0
    late.sender.init(NUM_TOKENS, late.prefill_aux)
    _forward_and_send(pd, late, g)
    assert _poll_until_done(sgl, late.receiver) == sgl.KVPoll.Success
    assert _poll_until_done(sgl, late.sender) == sgl.KVPoll.Success
    for req in (*(r for r, _ in holders), late):
        assert _holds(pd, req, "full"), req.room
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert pd.decode.mgr.applier.tracked()["decode_rooms"] == 0


def test_queued_rooms_leave_the_queue_when_aborted_or_past_the_waiting_budget(sgl, make_pd):
    """An aborted queued room gives its place up; one queued past the waiting budget fails on
    both sides at once, saying why; the rooms holding staging are untouched."""
    pd = make_pd(_cfg(target="exact", staging_mib=1))
    # With the prefill's session open, the holders are announced under the budget they were
    # registered with: the shortened one below applies to the queued rooms only.
    warm = _start_request(sgl, pd, room=8250, seed=93)
    assert _poll_until_done(sgl, warm.receiver) == sgl.KVPoll.Success
    holders = _fill_decode_staging(sgl, pd, first_room=8200)
    # Never written to (they get no range), so their slots may overlap each other's.
    first, _ = _request_metadata(sgl, pd, room=8290, seed=91, beside=tuple(r for r, _ in holders))
    second, _ = _request_metadata(sgl, pd, room=8291, seed=92,
                                  beside=tuple(r for r, _ in holders))
    assert _queued(pd) == 2
    first.receiver.abort()
    assert first.receiver.poll() == sgl.KVPoll.Failed
    assert _queued(pd) == 1
    # The budget is SGLang's waiting timeout (300 s by default): shortened on the live applier.
    pd.decode.mgr.applier.admission.waiting_s = 0.3
    assert _poll_until_done(sgl, second.receiver) == sgl.KVPoll.Failed
    msg = _failure_message(sgl, second.receiver)
    assert "of staging came free within 0.3 s" in msg and "--lynx-staging-mib" in msg, msg
    # The prefill hears of it now, not after its own bootstrap timeout.
    assert _poll_until_done(sgl, second.sender) == sgl.KVPoll.Failed
    assert _queued(pd) == 0
    pd.decode.mgr.applier.admission.waiting_s = 300.0
    for req, rg in holders:
        _forward_and_send(pd, req, rg)
    for req, _ in holders:
        assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
        assert _holds(pd, req, "full")
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert pd.decode.mgr.applier.tracked()["decode_rooms"] == 0


# More exact-target staging than 1 MiB in this file's two layers, and still one layer per window.
WINDOWED_TOKENS = 1000


@pytest.mark.rdma_vm
def test_a_room_larger_than_decode_staging_is_sent_in_segments(sgl, make_pd, caplog):
    """A room whose staging exceeds the whole pool is windowed (`backend.window`): here two
    segments of one layer take turns in one window of the whole pool. The KV arrives exact,
    Success comes only with the final KV (a windowed room never speculates, speculation on or
    not), and every segment's announcement and range is given back. In the soft-RoCE guest over
    verbs: each segment is one memory registration of its window, made again for the next."""
    cfg = _cfg(target="exact", staging_mib=1, speculate=True)
    pd = make_pd(cfg)
    decode = pd.decode.mgr
    plan = StreamPlan.build(decode.lynx.codec, decode.pool.shape, WINDOWED_TOKENS,
                            decode.lynx.chunk_tokens)
    assert plan.staging_bytes > decode.staging.nbytes
    with caplog.at_level(logging.INFO, logger="lynx_sglang.backend.decode_admission"):
        req = _start_request(sgl, pd, room=9100, seed=100, tokens=WINDOWED_TOKENS)
        assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert "sent in 2 segments of 1 layers through 1 windows" in caplog.text
    assert decode.applier.residual_outcome(req.room) is None  # not reported at Anchor time
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            src = getattr(pd.prefill.pool, kind)[layer][req.prefill_slots]
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots], src)
    assert int(pd.decode.meta.bootstrap_room[req.decode_aux, 0]) == req.room  # the aux came
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert decode.staging.free_bytes() == decode.staging.nbytes
    assert decode.applier.tracked()["decode_rooms"] == 0
    for session in decode.applier.sessions._sessions.values():
        assert session.pending_requests() == [IDENTITY_REQUEST]  # the session's own answer
    # The session goes on serving ordinary rooms (speculative: Success at Anchor time, the
    # Residual after it).
    nxt = _start_request(sgl, pd, room=9101, seed=101)
    assert _poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
    _wait("the next room's final KV", lambda: _holds(pd, nxt, "full"))


def test_the_residual_hold_of_a_windowed_room_sits_after_its_first_segment(sgl, make_pd, caplog):
    """The fault-injection hold (`lynx-sglang faults --windowed`, phase `between`) of a room sent
    in segments comes after its first segment, both streams of it: the decode has that segment
    applied while the next one waits; released early, the room ends exact."""
    pd = make_pd(_cfg(target="exact", staging_mib=1), residual_hold_s=LONG_HOLD_S)
    applier = pd.decode.mgr.applier
    with caplog.at_level(logging.WARNING, logger="lynx_sglang.backend.faults"):
        req = _start_request(sgl, pd, room=9300, seed=105, tokens=WINDOWED_TOKENS)
        _wait("the hold after the first segment",
              lambda: f"room {req.room} {FAULT_RESIDUAL_HOLD_LOG}" in caplog.text)
    room = applier.rooms.get(req.room)
    _wait("the first segment applied at the decode", lambda: room.progress.seg_applied == 1)
    time.sleep(0.3)
    assert room.progress.seg_applied == 1  # the next segment waits for the hold
    assert req.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    _release_holds_and_expect_full_kv(sgl, pd, req)


def test_the_anchor_hold_sits_mid_anchor(sgl, make_pd, caplog):
    """The fault-injection Anchor hold (`lynx-sglang faults`, phase `mid-anchor`) comes after the
    first half of the Anchor's layers: the decode has that half landed and counts the room in
    `decode_rooms_anchor_landing` while the rest waits; released early, the room ends exact."""
    pd = make_pd(_cfg(target="exact"), anchor_hold_s=LONG_HOLD_S)
    applier = pd.decode.mgr.applier
    with caplog.at_level(logging.WARNING, logger="lynx_sglang.backend.faults"):
        req = _start_request(sgl, pd, room=9400, seed=106)
        _wait("the Anchor hold", lambda: f"room {req.room} {FAULT_ANCHOR_HOLD_LOG} after 1 of "
                                         f"{LAYERS} layers" in caplog.text)
    _wait("half the Anchor landed at the decode",
          lambda: applier.tracked()["decode_rooms_anchor_landing"] == 1)
    room = applier.rooms.get(req.room)
    time.sleep(0.3)
    assert room.progress.anchor_layers_landed == 1  # the other layer waits for the hold
    assert req.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    _release_holds_and_expect_full_kv(sgl, pd, req)
    assert applier.tracked()["decode_rooms_anchor_landing"] == 0


def test_a_room_dropped_between_segments_frees_the_prefill_worker_at_once(sgl, make_pd,
                                                                         monkeypatch):
    """The decode aborts a windowed room once its first segment is in: the prefill, waiting for
    the next segment's announcement, stops as soon as SGLang drops the room (not at the transfer
    timeout: it would hold the worker that every room to that decode needs), and both sides give
    all their staging back. The decode's applier leaves the windowed room alone here: it stands
    in for a decode slow to apply the first segment."""
    cfg = _cfg(target="exact", staging_mib=1, speculate=True, transfer_timeout_s=60.0)
    pd = make_pd(cfg)
    applier = pd.decode.mgr.applier
    step = type(applier.windowed).step
    monkeypatch.setattr(type(applier.windowed), "step", lambda self, room: None)
    req = _start_request(sgl, pd, room=9200, seed=102, tokens=WINDOWED_TOKENS)

    def first_segment_in() -> bool:
        room = applier.rooms.get(req.room)
        return (room is not None and room.session is not None
                and room.session.recv_state(req.room, Stream.RESIDUAL).ok)

    _wait("the first segment at the decode", first_segment_in)
    t0 = time.monotonic()
    req.receiver.abort()
    assert req.receiver.poll() == sgl.KVPoll.Failed
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd), timeout=10.0)
    assert time.monotonic() - t0 < 10.0  # far inside the 60 s transfer timeout
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert applier.tracked()["decode_rooms"] == 0
    # The prefill's worker for this decode is free again: the next rooms go through.
    monkeypatch.setattr(type(applier.windowed), "step", step)
    for room, seed, tokens in ((9201, 103, NUM_TOKENS), (9202, 104, WINDOWED_TOKENS)):
        nxt = _start_request(sgl, pd, room=room, seed=seed, tokens=tokens)
        assert _poll_until_done(sgl, nxt.receiver) == sgl.KVPoll.Success
        _wait("the next room's final KV", lambda nxt=nxt: _holds(pd, nxt, "full"))


def test_prefill_death_mid_transfer_fails_the_room(sgl, make_pd):
    pd = make_pd(_cfg(target="exact"), residual_hold_s=RESIDUAL_HOLD_S)
    req = _start_request(sgl, pd, room=5005, seed=6)
    _wait("the whole Anchor at the decode", lambda: _anchor_in(pd, req))
    pd.prefill.mgr.endpoint.close()  # the prefill's data plane dies between the two streams
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    msg = _failure_message(sgl, req.receiver)
    assert "Residual stream failed" in msg, msg
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert not _holds(pd, req, "full")


def test_an_idle_prefill_that_dies_is_forgotten(sgl, make_pd):
    """A prefill rank that dies with none of its rooms in flight must be forgotten too: the
    decode used to drop its cached bootstrap info only when a room failed, so after a restart
    (SGLang's heartbeat slower, or off) the next request went to the dead rank and hung."""
    pd = make_pd(_cfg(target="exact"))
    req = _start_request(sgl, pd, room=5006, seed=7)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert pd.decode.mgr.connection_pool, "SGLang cached no bootstrap info to drop"
    pd.prefill.mgr.endpoint.close()  # the prefill's data plane dies while idle
    _wait("the decode to drop the dead rank's bootstrap info",
          lambda: not pd.decode.mgr.connection_pool)


@pytest.mark.parametrize("then", ["applied", "prefill_dies", "cancelled"])
def test_speculative_success_at_anchor_time(sgl, make_pd, then):
    """Speculative mode (the default): the room is Success for SGLang once the Anchor and the aux
    data are in the pool; the Residual goes on after SGLang has cleared the receiver, and its
    outcome is reported to the speculation controller (`residual_outcome`), not to SGLang."""
    from lynx_sglang.backend.outcome import ResidualState

    # Held until the test lets it go (`FaultPlan.release`), so no timing margin is needed
    # for the checks below, however loaded the machine; the hold's own bound is only a backstop.
    pd = make_pd(_cfg(target="exact", speculate=True, spec_policy="always",
                      transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    faults = pd.prefill.mgr.sender.faults
    decode = pd.decode.mgr.applier
    req = _start_request(sgl, pd, room=6006, seed=7)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert _holds(pd, req, "anchor")
    assert torch.equal(pd.decode.meta.output_ids[req.decode_aux],
                       pd.prefill.meta.output_ids[req.prefill_aux])
    assert decode.residual_outcome(req.room).state is ResidualState.PENDING
    req.receiver.clear()  # SGLang commits the request to its running batch
    staging = pd.decode.mgr.staging
    assert staging.free_bytes() < staging.nbytes  # the Residual is still expected
    # SGLang no longer polls the room: the outcome must wake the scheduler's idle wait itself.
    woken: list[int] = []
    reporter = decode.reporter
    reporter.link = replace(reporter.link, progress=lambda: woken.append(req.room))

    if then == "applied":
        faults.release()
        outcome = _wait("the Residual outcome", lambda: (
            o if (o := decode.residual_outcome(req.room)).state is not ResidualState.PENDING
            else None))
        assert outcome.state is ResidualState.APPLIED, outcome
        _wait("the applied Residual to wake the scheduler", lambda: woken)
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                                   getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
        decode.forget(req.room)
        assert decode.residual_outcome(req.room) is None
    elif then == "prefill_dies":
        pd.prefill.mgr.endpoint.close()
        outcome = _wait("the Residual outcome", lambda: (
            o if (o := decode.residual_outcome(req.room)).state is not ResidualState.PENDING
            else None))
        assert outcome.state is ResidualState.FAILED, outcome
        assert "Residual stream failed" in outcome.reason, outcome
        _wait("the failed Residual to wake the scheduler", lambda: woken)
        assert _holds(pd, req, "anchor")
    else:
        # The request's KV slots are being freed: nothing may be written into them afterwards.
        assert decode.cancel(req.room)
        assert decode.residual_outcome(req.room) is None
        _let_residual_go_after_release(pd, req)
        assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed  # its Residual is refused
        assert _holds(pd, req, "anchor")
    assert staging.free_bytes() == staging.nbytes


def test_a_decode_setup_failure_reaches_the_prefill_at_once(sgl, make_pd):
    """The decode refuses a room before any transfer (here: a decode-side prefix, which Lynx does
    not support): the prefill hears it at once instead of waiting for metadata until SGLang's
    bootstrap timeout (300 s)."""
    pd = make_pd(_cfg(target="exact"))
    room = 7007
    sender = sgl.Sender(mgr=pd.prefill.mgr, bootstrap_addr=pd.bootstrap_addr, bootstrap_room=room)
    receiver = sgl.Receiver(mgr=pd.decode.mgr, bootstrap_addr=pd.bootstrap_addr,
                            bootstrap_room=room)
    assert pd.decode.mgr.try_ensure_parallel_info(pd.bootstrap_addr)
    receiver.init(0)
    slots = (torch.arange(NUM_TOKENS) + 1).to(torch.int32).numpy()
    receiver.send_metadata(slots, 0, decode_prefix_len=4)
    assert receiver.poll() == sgl.KVPoll.Failed
    assert "prefix cache" in _failure_message(sgl, receiver)
    t0 = time.monotonic()
    assert _poll_until_done(sgl, sender) == sgl.KVPoll.Failed
    assert time.monotonic() - t0 < 10.0


# ---- the runtime the manager composes for its hooks (lynx_sglang.runtime) ---------------------


def test_the_manager_composes_the_runtime_its_hooks_find(sgl, make_pd):
    """Once SGLang hands it the KV pool, each manager holds its role's components in one
    `LynxRuntime`, attached to that pool too: where the hooks inside the model and the KV cache
    find it (here the pool's own `set_kv_buffer` hook, opening a layer-streamed forward's gate)."""
    from types import SimpleNamespace

    from lynx_sglang import hooks, runtime
    from lynx_sglang.backend.layer_stream import LayerGate

    pd = make_pd(_cfg(), _cfg(speculate=True))
    for side in (pd.prefill, pd.decode):
        assert runtime.of_kv_pool(side.pool) is side.mgr.lynx_runtime
    prefill, decode = pd.prefill.mgr.lynx_runtime, pd.decode.mgr.lynx_runtime
    assert prefill.sender is pd.prefill.mgr.sender and prefill.spec is None
    assert prefill.layer_stream is not None  # a CPU pool
    assert decode.sender is None and decode.layer_stream is None
    assert decode.spec is not None and decode.spec.transfers is pd.decode.mgr.applier
    assert prefill.idle is not decode.idle
    prefill.layer_stream.gate = gate = LayerGate(LAYERS)
    hooks.set_kv_buffer_after(None, pd.prefill.pool, SimpleNamespace(layer_id=1))
    assert gate.opened == 2
    prefill.layer_stream.gate = None


# ---- layer streaming (backend.layer_stream): the Anchor goes out while the forward runs -------


def _start_streamed_request(sgl: _SGLang, pd: PD, room: int, seed: int):
    """`_start_request` as a layer-streamed prefill drives it: the room is handed to the sender
    with a gate before its "forward" has written any KV; the caller writes the layers
    (`_forward_layer`), opens the gate and hands the room over (`sender.send`)."""
    from lynx_sglang.backend.layer_stream import LayerGate

    req, g = _open_request(sgl, pd, room, seed)
    gate = LayerGate(LAYERS)
    assert pd.prefill.mgr.sender.start_early(
        [(room, req.prefill_slots.numpy().astype("int64"))], gate) == {room}
    return req, gate, g


def _anchor_layers_landed(pd: PD, room: int) -> int:
    r = pd.decode.mgr.applier.rooms.get(room)
    return 0 if r is None else r.progress.anchor_layers_landed


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_a_layer_streamed_anchor_lands_before_the_forward_ends(sgl, make_pd, target):
    """Layers written so far are sent at once, Anchor and Residual: the decode holds the first
    layers at full precision while the last layer is still being computed, and the room ends
    bit-exact (int8: the INT8 reconstruction) once handed over."""
    pd = make_pd(_cfg(target=target))
    req, gate, g = _start_streamed_request(sgl, pd, room=1101, seed=21)
    for layer in range(LAYERS - 1):
        _forward_layer(pd, req, layer, g)
        gate.written(layer)
    _wait("the first layers' Anchor at the decode",
          lambda: _anchor_layers_landed(pd, req.room) == LAYERS - 1)
    # Their Residual went with them: those layers are at full precision in the pool already.
    _wait("the first layers' Residual applied at the decode",
          lambda: pd.decode.mgr.applier.rooms.get(req.room).progress.final_layers == LAYERS - 1)
    # Not a layer more than the forward wrote, and no Success before the hand-over.
    time.sleep(0.2)
    assert _anchor_layers_landed(pd, req.room) == LAYERS - 1
    assert pd.decode.mgr.applier.rooms.get(req.room).progress.final_layers == LAYERS - 1
    assert req.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    _forward_layer(pd, req, LAYERS - 1, g)
    gate.finish()
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, req.receiver)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    assert _holds(pd, req, "full")
    if target == "exact":
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                                   getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
    assert int(pd.decode.meta.bootstrap_room[req.decode_aux, 0]) == req.room
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_layer_streamed_forward_longer_than_the_transfer_timeout_succeeds(sgl, make_pd):
    """The transfer timeout is a stall deadline: a forward that writes a layer every 1.2 s with a
    2 s timeout keeps its room alive for far longer than 2 s in all. (Before, the deadline ran
    from the first landed byte: a long prompt's forward failed its own transfer.)"""
    timeout_s, gap_s = 2.0, 1.2
    pd = make_pd(_cfg(target="exact", transfer_timeout_s=timeout_s))
    req, gate, g = _start_streamed_request(sgl, pd, room=1103, seed=23)
    t0 = time.monotonic()
    for layer in range(LAYERS):
        _forward_layer(pd, req, layer, g)
        gate.written(layer)
        time.sleep(gap_s)
    gate.finish()
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, req.receiver)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    assert time.monotonic() - t0 > timeout_s + 0.2
    assert _holds(pd, req, "full")


def _all_succeed(sgl: _SGLang, pd: PD, reqs) -> None:
    """Each request ends Success on both sides with the prefill's exact KV in the decode pool."""
    for req in reqs:
        assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
            _failure_message(sgl, req.receiver)
        assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
        assert _holds(pd, req, "full")


def _stream_two_rooms(sgl: _SGLang, pd: PD, rooms: tuple[int, int], seed: int):
    """Two requests whose prompts one forward computes, handed to the sender with one gate; the
    forward writes layer 0 of both. Returns them (with their generators) and the gate once layer
    0 of both rooms is at the decode."""
    from lynx_sglang.backend.layer_stream import LayerGate

    a, ga = _open_request(sgl, pd, room=rooms[0], seed=seed)
    b, gb = _open_request(sgl, pd, room=rooms[1], seed=seed + 1, beside=(a,))
    gate = LayerGate(LAYERS)
    assert pd.prefill.mgr.sender.start_early(
        [(r.room, r.prefill_slots.numpy().astype("int64")) for r in (a, b)], gate) == set(rooms)
    for req, g in ((a, ga), (b, gb)):
        _forward_layer(pd, req, 0, g)
    gate.written(0)
    _wait("the first layer of both rooms at the decode",
          lambda: _anchor_layers_landed(pd, a.room) == _anchor_layers_landed(pd, b.room) == 1)
    return (a, ga), (b, gb), gate


def test_the_rooms_of_one_forward_stream_their_layers_together(sgl, make_pd):
    """Two rooms computed by one forward and bound for one decode go to its worker as one group:
    each layer goes out for both as the forward writes it (`_stream_two_rooms` waits for layer 0
    of both before the forward goes on). Sent one room after the other, the second room's first
    layer would wait for the first room's hand-over after the forward."""
    pd = make_pd(_cfg(target="exact"))
    (a, ga), (b, gb), gate = _stream_two_rooms(sgl, pd, (1111, 1112), seed=31)
    for req, g in ((a, ga), (b, gb)):
        _forward_layer(pd, req, 1, g)
    gate.finish()
    for req in (a, b):
        req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    _all_succeed(sgl, pd, (a, b))
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_room_that_fails_in_a_streamed_group_leaves_the_others(sgl, make_pd):
    """One room of a layer-streamed group dropped by SGLang during the forward fails alone; the
    other room of the group is sent whole."""
    pd = make_pd(_cfg(target="exact"))
    (a, ga), (b, gb), gate = _stream_two_rooms(sgl, pd, (1113, 1114), seed=33)
    a.sender.abort()
    for req, g in ((a, ga), (b, gb)):
        _forward_layer(pd, req, 1, g)
    gate.finish()
    b.sender.send(b.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert _poll_until_done(sgl, b.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, b.receiver)
    assert _poll_until_done(sgl, b.sender) == sgl.KVPoll.Success
    assert _poll_until_done(sgl, a.receiver) == sgl.KVPoll.Failed
    _failure_message(sgl, a.receiver)
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_windowed_room_in_a_layer_streamed_group_goes_after_the_forward(sgl, make_pd, caplog):
    """One forward computes an ordinary room and one too large for the decode's staging: the
    ordinary room streams its layers during the forward, the windowed one waits for the hand-over
    and goes in segments after it (`_WindowedWriter`). Both arrive exact, and every byte of
    staging comes back on both sides."""
    from lynx_sglang.backend.layer_stream import LayerGate

    pd = make_pd(_cfg(target="exact", staging_mib=1))
    decode = pd.decode.mgr
    gate = LayerGate(LAYERS)
    with caplog.at_level(logging.INFO, logger="lynx_sglang.backend.decode_admission"):
        # 800 tokens: past the 781 that 1 MiB of staging holds whole; both fit the test's pool.
        a, ga = _open_request(sgl, pd, room=1131, seed=51, tokens=200)
        b, gb = _open_request(sgl, pd, room=1132, seed=52, beside=(a,), tokens=800)
        assert pd.prefill.mgr.sender.start_early(
            [(r.room, r.prefill_slots.numpy().astype("int64")) for r in (a, b)], gate) == {1131,
                                                                                          1132}
        _forward_layer(pd, a, 0, ga)
        _forward_layer(pd, b, 0, gb)
        gate.written(0)
        _wait("the ordinary room's first layer at the decode",
              lambda: _anchor_layers_landed(pd, a.room) == 1)
        assert _anchor_layers_landed(pd, b.room) == 0  # the windowed room waits for the forward
        _forward_layer(pd, a, 1, ga)
        _forward_layer(pd, b, 1, gb)
        gate.finish()
        for req in (a, b):
            req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                            num_kv_tokens=len(req.prefill_slots))
        _all_succeed(sgl, pd, (a, b))
    assert "room 1132 needs" in caplog.text and "sent in 2 segments" in caplog.text
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][b.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][b.prefill_slots])
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert decode.staging.free_bytes() == decode.staging.nbytes
    assert decode.applier.tracked()["decode_rooms"] == 0
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def _residual_in(pd: PD, req: Request) -> bool:
    room = pd.decode.mgr.applier.rooms.get(req.room)
    return room is not None and room.progress.final_layers == LAYERS


def test_rooms_handed_over_together_send_every_anchor_before_a_residual(sgl, make_pd):
    """Rooms SGLang hands over while handling one forward's results (`PrefillSender.batched`,
    as the `process_batch_result` hook runs it, finding the sender through the scheduler's
    prefill queue) go to their decode's worker as one group: the second room's Anchor does not
    wait for the first room's Residual (here held back 2 s)."""
    from types import SimpleNamespace

    from lynx_sglang import hooks

    pd = make_pd(_cfg(target="exact"), residual_hold_s=RESIDUAL_HOLD_S)
    a, ga = _open_request(sgl, pd, room=1121, seed=41)
    b, gb = _open_request(sgl, pd, room=1122, seed=42, beside=(a,))
    for req, g in ((a, ga), (b, gb)):
        for layer in range(LAYERS):
            _forward_layer(pd, req, layer, g)

    def process_batch_result(scheduler):
        for req in (a, b):
            req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                            num_kv_tokens=NUM_TOKENS)

    scheduler = SimpleNamespace(
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=pd.prefill.mgr))
    hooks.process_batch_result_around(process_batch_result, scheduler)
    _wait("both Anchors at the decode", lambda: _anchor_in(pd, a) and _anchor_in(pd, b))
    assert not _residual_in(pd, a), "the first room's Residual came before the second's Anchor"
    _all_succeed(sgl, pd, (a, b))
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))


def test_a_failed_forward_fails_the_layer_streamed_room(sgl, make_pd):
    pd = make_pd(_cfg(target="exact"))
    req, gate, g = _start_streamed_request(sgl, pd, room=1102, seed=22)
    _forward_layer(pd, req, 0, g)
    gate.written(0)
    gate.fail("RuntimeError: out of memory")
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    assert "forward failed before layer 1" in _failure_message(sgl, req.sender)
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    _failure_message(sgl, req.receiver)  # SGLang's decode clears the room with it
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def _free_slots(req: Request, count: int) -> torch.Tensor:
    used = set(req.prefill_slots.tolist())
    return torch.tensor([s for s in range(1, POOL_TOKENS + 1) if s not in used][:count])


def _forward_then_swap_tail(pd: PD, req: Request, g: torch.Generator, count: int,
                            first_layer: int = 0) -> torch.Tensor:
    """The forward (its layers from `first_layer` on), then what SGLang's prefix cache does to its
    last `count` slots: the slots SGLang hands over, whose last `count` are other slots holding a
    copy of the same KV."""
    for layer in range(first_layer, LAYERS):
        _forward_layer(pd, req, layer, g)
    swapped = req.prefill_slots.clone()
    swapped[-count:] = _free_slots(req, count)
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        for layer in range(LAYERS):
            buffers[layer][swapped[-count:]] = buffers[layer][req.prefill_slots[-count:]]
    return swapped


def test_slots_the_prefix_cache_swapped_for_the_same_kv_are_taken(sgl, make_pd):
    """After the forward SGLang's prefix cache may replace slots the forward wrote by cached ones
    holding the same tokens (and free the forward's). With the same bits in every layer the
    room goes on from the cached slots and ends bit-exact."""
    pd = make_pd(_cfg(target="exact"))
    req, gate, g = _start_streamed_request(sgl, pd, room=1103, seed=23)
    swapped = _forward_then_swap_tail(pd, req, g, 3)
    gate.finish()
    req.sender.send(swapped.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    # SGLang frees the forward's own slots, which the next forward may write.
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        for layer in range(LAYERS):
            buffers[layer][req.prefill_slots[-3:]] = 0
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, req.receiver)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][swapped])


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_slots_swapped_for_different_kv_are_sent_as_the_forward_wrote_them(sgl, make_pd, target,
                                                                             caplog):
    """The same swap with other bits in the cached slots (two requests computed the same tokens
    in different batches): the room is sent from copies of the forward's own rows, made before
    SGLang can write the freed slots again, so every layer at the decode is what the forward
    computed (the KV its first token came from, and the Anchor layers already sent)."""
    pd = make_pd(_cfg(target=target))
    req, gate, g = _start_streamed_request(sgl, pd, room=1105, seed=25)
    # The first layer goes out before the swap, the others after it.
    _forward_layer(pd, req, 0, g)
    gate.written(0)
    _wait("layer 0's Anchor at the decode", lambda: _anchor_layers_landed(pd, req.room) == 1)
    swapped = _forward_then_swap_tail(pd, req, g, 2, first_layer=1)
    forward = {kind: [getattr(pd.prefill.pool, kind)[layer][req.prefill_slots].clone()
                      for layer in range(LAYERS)] for kind in ("k_buffer", "v_buffer")}
    for layer in (0, LAYERS - 1):
        pd.prefill.pool.v_buffer[layer][swapped[-1:]] += 1.0
    # Handed over while the sender still waits on layer 1 (a worker behind the forward).
    with caplog.at_level(logging.INFO, logger="lynx_sglang"):
        req.sender.send(swapped.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert "replaced 2 of the slots its forward wrote by cached ones holding other bits" \
        in caplog.text
    # SGLang frees the forward's own slots, and the next forward writes them.
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        for layer in range(LAYERS):
            buffers[layer][req.prefill_slots[-2:]] = 7.0
    gate.finish()
    assert _poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        _failure_message(sgl, req.receiver)
    assert _poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            landed = getattr(pd.decode.pool, kind)[layer][req.decode_slots]
            if target == "exact":
                assert torch.equal(landed, forward[kind][layer])
            else:
                assert not torch.equal(landed[-2:], torch.full_like(landed[-2:], 7.0))
    if target == "int8":
        # int8 lands the INT8 reconstruction: it is the forward's, not the cached rows'.
        cached = pd.prefill.pool.v_buffer[LAYERS - 1][swapped[-1:]]
        landed = pd.decode.pool.v_buffer[LAYERS - 1][req.decode_slots[-1:]]
        want = forward["v_buffer"][LAYERS - 1][-1:]
        assert (landed.float() - want.float()).abs().max() < \
            (landed.float() - cached.float()).abs().max()
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_request_aborted_during_its_forward_stops_streaming(sgl, make_pd, monkeypatch):
    """SGLang aborts a request whose client left while its forward ran, and frees its KV slots
    right after the forward: the streamed room stops reading them and fails as aborted (not as
    bad data), nothing is held."""
    from lynx_sglang import metrics
    from lynx_sglang.failures import FailureKind

    kinds: list[FailureKind] = []
    monkeypatch.setattr(metrics, "record_failure", kinds.append)
    pd = make_pd(_cfg(target="exact"))
    req, gate, g = _start_streamed_request(sgl, pd, room=1104, seed=24)
    _forward_layer(pd, req, 0, g)
    gate.written(0)
    _wait("layer 0's Anchor at the decode", lambda: _anchor_layers_landed(pd, req.room) == 1)
    req.sender.abort()
    for layer in range(1, LAYERS):
        _forward_layer(pd, req, layer, g)
    gate.finish()
    _wait("the streamed room to be given up",
          lambda: pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0, timeout=5.0)
    _wait("the prefill staging to be freed", lambda: _prefill_staging_free(pd), timeout=5.0)
    assert _anchor_layers_landed(pd, req.room) < LAYERS
    assert kinds and set(kinds) == {FailureKind.ABORTED}, kinds
