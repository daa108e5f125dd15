"""The harness the test_conn_*.py modules share: the `lynx` transfer backend's classes
(lynx_sglang.backend) with SGLang's own machinery, in one process over loopback: real `KVArgs`
filled the way SGLang's `PrefillBootstrapQueue._init_kv_manager` and
`DecodePreallocQueue._init_kv_manager` fill them (SGLang's `get_kv_transfer_buf_infos`,
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
- stopping a manager: LynxKVManager has no teardown of its own threads, so `pd_factory` sets its
  `_stop` event before SGLang's `teardown()`.

Most tests run the managers non-speculative (`--no-lynx-speculate`): a decode room becomes
Success only once the Residual is in the KV pool, and Failed (with its staging freed) when the
transfer cannot finish (`make_cfg`); test_conn_transfer.py checks the speculative contract too
(Success at Anchor time, the Residual's outcome reported through `residual_outcome`).

conftest.py turns `sglang_names` and `pd_factory` into the `sgl` and `make_pd` fixtures.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgspec
import pytest
import torch

from lynx_kernels import decode, encode
from lynx_sglang.config import LynxConfig
from lynx_sglang.names import (
    CONFIG_ENV,
    FAULT_ANCHOR_DELAY_ENV,
    FAULT_RESIDUAL_DELAY_ENV,
)

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
# long enough for a test to act between the Anchor and the Residual, short enough to keep the tests
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
class SGLang:
    """The SGLang names the tests use, imported once the CPU engine is set up."""

    KVPoll: type
    KVTransferError: type
    DisaggregationMode: type
    # What SGLang's get_kv_class answers for the `lynx` backend.
    KVArgs: type
    Manager: type
    # The sender class, or where its constructor takes the prefill's TP ranks and PP rank
    # (0.5.21, which the prefill queue passes), the class with this one rank's.
    Sender: Callable
    Receiver: type
    BootstrapServer: type
    MetadataBuffers: type
    MHATokenToKVPool: type
    get_kv_transfer_buf_infos: Callable
    # None where the release has no PD KV layouts (0.5.22: KVArgs has no kv_layout).
    get_pd_kv_layout: Callable | None
    build_kv_layer_ids: Callable
    setup_state_kv_args: Callable
    get_free_port: Callable
    context: object
    server_args: object


@contextlib.contextmanager
def sglang_names() -> Iterator[SGLang]:
    """The `lynx` backend installed in SGLang and SGLang's scheduler config published (see the
    module docstring), for as long as the context lasts; needs SGLang importable in this process
    (conftest's `sglang_in_process`)."""
    with contextlib.ExitStack() as stack:
        from lynx_sglang import plugin

        # Before importing get_kv_class: the hook patches module attributes, not this frame's.
        plugin.install_backend()
        from sglang.srt.disaggregation import utils as disagg_utils
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
            setup_state_kv_args,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.runtime_context import get_context, get_parallel
        from sglang.srt.utils.network import get_free_port

        backend = TransferBackend(plugin.BACKEND_NAME)
        sender = get_kv_class(backend, KVClassType.SENDER)
        if "dest_tp_ranks" in inspect.signature(sender).parameters:
            sender = functools.partial(sender, dest_tp_ranks=[0], pp_rank=0)
        override = get_context().override_server_args(
            host=LOOPBACK, disaggregation_transfer_backend=plugin.BACKEND_NAME,
            enable_pd_role_switch=True)
        # The managers read the flag from the ServerArgs they are given (the published one keeps
        # its raw, unresolved value), so they get a copy with it set.
        server_args = msgspec.structs.replace(override.install(), enable_pd_role_switch=True)
        stack.callback(override.restore)
        stack.enter_context(get_parallel().override(
            attn_tp_rank=0, attn_cp_rank=0, attn_dcp_rank=0, attn_dp_rank=0, pp_group=None))
        yield SGLang(
            KVPoll=KVPoll, KVTransferError=KVTransferError, DisaggregationMode=DisaggregationMode,
            KVArgs=get_kv_class(backend, KVClassType.KVARGS),
            Manager=get_kv_class(backend, KVClassType.MANAGER),
            Sender=sender,
            Receiver=get_kv_class(backend, KVClassType.RECEIVER),
            BootstrapServer=get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER),
            MetadataBuffers=MetadataBuffers, MHATokenToKVPool=MHATokenToKVPool,
            get_kv_transfer_buf_infos=get_kv_transfer_buf_infos,
            get_pd_kv_layout=getattr(disagg_utils, "get_pd_kv_layout", None),
            build_kv_layer_ids=build_kv_layer_ids,
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


def mha_pool(sgl: SGLang):
    """The MHA pool every test_conn_*.py module runs on: bf16, page size 1, on CPU."""
    return sgl.MHATokenToKVPool(size=POOL_TOKENS, page_size=1, dtype=torch.bfloat16,
                                head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                                enable_memory_saver=False)


def _build_side(sgl: SGLang, mode, make_pool: Callable[[SGLang], object] = mha_pool,
                kv_head_num: int = HEADS, mla: bool = False) -> Side:
    """What `_init_kv_manager` of SGLang's prefill / decode queue does, for the pool `make_pool`
    builds on CPU (an MHA pool by default; `mla`: an MLA pool, as SGLang's `is_mla_backend`)."""
    pool = make_pool(sgl)
    meta = sgl.MetadataBuffers(AUX_ROWS, hidden_size=16, hidden_states_dtype=torch.bfloat16,
                               max_sampling_mask_tokens=16)
    kv_args = sgl.KVArgs()
    kv_args.engine_rank = 0
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = 0
    kv_args.rust_http_port = None
    kv_args.kv_cache_dtype_str = "auto"
    if sgl.get_pd_kv_layout is not None:
        kv_args.kv_layout = sgl.get_pd_kv_layout(pool)
    kv_args.prefill_start_layer = pool.start_layer
    kv_args.prefill_end_layer = pool.end_layer
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = (
        sgl.get_kv_transfer_buf_infos(pool))
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = sgl.build_kv_layer_ids(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, num_draft_entries=0,
        num_hidden_layers=LAYERS)
    if not mla:  # SGLang's MLA KVArgs carry no head counts (PrefillBootstrapQueue, decode too)
        kv_args.kv_head_num = kv_head_num
        kv_args.total_kv_head_num = kv_head_num
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = meta.get_buf_infos()
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    sgl.setup_state_kv_args(kv_args, pool, None, LAYERS, req_to_token_pool=None)
    mgr = sgl.Manager(kv_args, mode, sgl.server_args, mla)
    mgr.attach_kv_pool(pool)
    return Side(mgr, pool, meta)


def _stop(mgr) -> None:
    # LynxKVManager's own threads watch `_stop`; SGLang's teardown() stops the rest, closes the
    # ZMQ sockets and (deregister_buffer_to_engine) the transport endpoint.
    mgr._stop.set()
    mgr.teardown()


@contextlib.contextmanager
def pd_factory(sgl: SGLang, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., PD]]:
    """make_pd(prefill=LynxConfig, decode=LynxConfig, residual_hold_s=0, anchor_hold_s=0,
    make_pool=mha_pool, kv_head_num=HEADS, mla=False) -> PD, on a fresh bootstrap server;
    everything it started is stopped when the context ends."""
    started: list = []

    def _make(prefill: LynxConfig, decode: LynxConfig | None = None,
              residual_hold_s: float = 0.0, anchor_hold_s: float = 0.0,
              make_pool: Callable[[SGLang], object] = mha_pool, kv_head_num: int = HEADS,
              mla: bool = False) -> PD:
        port = sgl.get_free_port()
        sgl.context.override("conn_pair", disaggregation_bootstrap_port=port)
        server = sgl.BootstrapServer(host=LOOPBACK, port=port)
        started.append(server.close)
        # SGLang's managers bind to, and announce, get_local_ip_auto().
        monkeypatch.setenv("SGLANG_HOST_IP", LOOPBACK)
        sides = []
        for mode, cfg, delays in (
                (sgl.DisaggregationMode.PREFILL, prefill, (residual_hold_s, anchor_hold_s)),
                (sgl.DisaggregationMode.DECODE, decode or prefill, (0.0, 0.0))):
            monkeypatch.setenv(CONFIG_ENV, json.dumps(cfg.flat()))
            monkeypatch.setenv(FAULT_RESIDUAL_DELAY_ENV, str(delays[0]))
            monkeypatch.setenv(FAULT_ANCHOR_DELAY_ENV, str(delays[1]))
            side = _build_side(sgl, mode, make_pool, kv_head_num, mla)
            started.append(lambda m=side.mgr: _stop(m))
            sides.append(side)
        return PD(sides[0], sides[1], f"{LOOPBACK}:{port}")

    try:
        yield _make
    finally:
        for stop in reversed(started):
            stop()


# ---- helpers --------------------------------------------------------------------------------


def make_cfg(**kw) -> LynxConfig:
    # By default the non-speculative contract (`--no-lynx-speculate`): Success only with the
    # Residual in the pool, failures reported to SGLang as Failed.
    return LynxConfig.build(**{"staging_mib": 4, "speculate": False, **TIMEOUTS, **TRANSPORT, **kw})


def wait_for(what: str, cond: Callable[[], object], timeout: float = WAIT_S):
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


def open_request(sgl: SGLang, pd: PD, room: int, seed: int, beside: tuple[Request, ...] = (),
                  tokens: int = NUM_TOKENS) -> tuple[Request, torch.Generator]:
    """A request through the conn classes up to the prefill's `send`, in the order SGLang's
    prefill bootstrap queue and decode prealloc queue drive them: its slots on both sides (slot 0
    is SGLang's padding slot; none of `beside`'s, requests in flight at the same time),
    SGLang's metadata row on the prefill, the decode's KV indices at the prefill. Returns the
    request and the generator of its random data."""
    req, g = request_metadata(sgl, pd, room, seed, beside, tokens)
    wait_for("the prefill to get the decode's KV indices",
          lambda: req.sender.poll() == sgl.KVPoll.WaitingForInput)
    req.sender.init(tokens, req.prefill_aux)
    return req, g


def request_metadata(sgl: SGLang, pd: PD, room: int, seed: int, beside: tuple[Request, ...] = (),
                      tokens: int = NUM_TOKENS) -> tuple[Request, torch.Generator]:
    """`open_request` up to the decode's `send_metadata` (which the receiver may hold back)."""
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


def forward_layer(pd: PD, req: Request, layer: int, g: torch.Generator) -> None:
    """What the prefill forward writes of one layer: random K and V in the request's slots."""
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        x = torch.randn(len(req.prefill_slots), HEADS, HEAD_DIM, generator=g) * (layer + 1)
        buffers[layer][req.prefill_slots] = x.to(torch.bfloat16)


def start_request(sgl: SGLang, pd: PD, room: int, seed: int, beside: tuple[Request, ...] = (),
                   tokens: int = NUM_TOKENS) -> Request:
    """A request whose prefill KV is all there when SGLang sends it (after its forward)."""
    req, g = open_request(sgl, pd, room, seed, beside, tokens)
    forward_and_send(pd, req, g)
    return req


def forward_and_send(pd: PD, req: Request, g: torch.Generator) -> None:
    for layer in range(LAYERS):
        forward_layer(pd, req, layer, g)
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                    num_kv_tokens=len(req.prefill_slots))


def poll_until_done(sgl: SGLang, party) -> int:
    done = (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    # A 1-tuple: KVPoll.Failed is 0, which wait_for would take for "not yet".
    return wait_for(f"{type(party).__name__} to reach Success or Failed",
                 lambda: (s,) if (s := party.poll()) in done else None)[0]


def failure_message(sgl: SGLang, party) -> str:
    """What SGLang's queues do with a Failed room: failure_exception() (clears it, raises)."""
    with pytest.raises(sgl.KVTransferError) as info:
        party.failure_exception()
    return str(info.value)


def expected_kv(pd: PD, req: Request, stage: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
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


def prefill_staging_free(pd: PD) -> bool:
    return pd.prefill.mgr.staging.free_bytes() == pd.prefill.mgr.staging.nbytes


def release_holds_and_expect_full_kv(sgl: SGLang, pd: PD, req: Request) -> None:
    """End the prefill's fault-injection hold early: the room then succeeds with its exact KV
    in the decode's pool, and the prefill gives its staging back."""
    pd.prefill.mgr.sender.faults.release()
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert holds(pd, req, "full")
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))


def let_residual_go_after_release(pd: PD, req: Request) -> None:
    """End the prefill's Residual hold (`FaultPlan.release`) once the decode's release of
    `req` has reached it over the control plane: a Residual let go before that is written and
    reported Success (the decode drops its bytes), which is right, but not what the test checks."""
    sender = pd.prefill.mgr.sender
    wait_for("the prefill to hear of the release", lambda: any(
        req.room in s._peer_released for s in list(sender.sessions._sessions.values())))
    sender.faults.release()


def holds(pd: PD, req: Request, stage: str) -> bool:
    return all(torch.equal(got, want) for got, want in expected_kv(pd, req, stage))


def anchor_in(pd: PD, req: Request) -> bool:
    """The decode has validated the room's whole Anchor and seen its stream end (every layer's
    bytes can land before the end does: a fault injected between the two is not "after the
    Anchor"). Non-speculative rooms never write the Anchor into the pool (nothing would read it
    before the Residual), so the pool cannot tell."""
    room = pd.decode.mgr.applier.rooms.get(req.room)
    return (room is not None and room.progress.anchor_layers_landed == LAYERS
            and room.t_anchor_landed is not None)
