"""The `lynx` transfer backend's KV manager as SGLang sees it: LynxKVManager (SGLang finds it, and
the per-request classes of `backend.conn`, through `get_kv_class`, hooked by `lynx_sglang.plugin`).

Control plane: SGLang's own. LynxKVManager derives from SGLang's MooncakeKVManager (itself a
CommonKVManager, `upstream.kv_transfer.KVManagerBase`) and keeps its bootstrap registration, the
decode's KV-args registration and per-request TransferInfo messages, status/abort messages and
heartbeats unchanged; it replaces only the data path (Mooncake's one-sided writes) with
`lynx_transport` and the codec. What differs by disaggregation mode is one role object, chosen
once in the constructor, to which the manager delegates:

- prefill: `backend.prefill.role.PrefillRole` (the sender, thread `lynx-send`; the rank's signed
  bootstrap rows and their leases; aborts that arrive before their room);
- decode: `backend.decode.role.DecodeRole` (the applier, threads `lynx-accept`, `lynx-apply`; the
  speculation controller).

SGLang-facing methods (the engine hooks of MooncakeKVManager):
  init_engine / register_buffer_to_engine / deregister_buffer_to_engine / get_session_id
      the transport endpoint and its registered staging memory (`backend.staging`); the session
      id SGLang carries in the decode's registration is the endpoint's address.
  add_transfer_request (prefill)        queue a chunk of a room's KV slots on the sender.
  update_status                         the role's first: a decode holds a prefill Success until
                                        the Residual is in the KV pool; a prefill fails a room
                                        its decode aborted before it arrived.
  record_failure                        a reason this side found itself is never overwritten.
  attach_kv_pool                        the plugin hands over SGLang's KV pool after start-up;
                                        the process's `runtime.LynxRuntime` is completed then.
  _register_topology_row (prefill)      SGLang's bootstrap registration, plus this process's
                                        rank key (`backend.rank_key`).

The manager builds the composition its hooks act on (`lynx_runtime`, a `runtime.LynxRuntime`): the
idle waiter at construction, the role's components once it has the pool.

Every status this backend decides reaches SGLang through one method, `report_status`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from .. import runtime
from ..config import LynxConfig
from ..errors import LynxConfigError
from ..idle import IdleWaiter
from ..metrics import Metrics
from ..recorder import Recorder
from ..runtime import LynxRuntime
from ..sglang_support import check_anchor_safety
from ..trace import Trace
from ..upstream.fingerprints import check_release
from ..upstream.hook_check import verify_applied
from ..upstream.kv_transfer import (
    DisaggregationMode,
    KVArgs,
    KVManagerBase,
    KVPoll,
    ServerArgs,
    push_sockets,
    track_worker_thread,
)
from .conn import lookup_prefill_rank
from .decode.role import DecodeRole
from .peer_sockets import PeerSockets
from .plan import log_staging_fit
from .pool import KINDS, KVPoolView
from .prefill.role import PrefillRole
from .rank_key import RankKey
from .registration import Registrar
from .staging import StagingPool
from .transport_setup import open_endpoint

logger = logging.getLogger(__name__)


class Role(Protocol):
    """What the manager delegates to by disaggregation mode (`PrefillRole`, `DecodeRole`); a
    prefill's role also takes `add_transfer_request`, a decode's `register_rx_room`, the calls
    SGLang makes on that side only."""

    def start(self, recorder: Recorder,
              start_thread: Callable[[Callable, str], None]) -> None: ...
    def tracked(self) -> dict[str, int]: ...
    def complete_runtime(self, rt: LynxRuntime) -> LynxRuntime: ...
    def update_status(self, room: int, status: KVPoll,
                      sglang_update: Callable[[int, KVPoll], None]) -> bool: ...
    def register_row(self, url: str, payload: dict) -> dict: ...
    def watch_receive(self, recv: Callable[[], list | None]) -> Callable[[], list | None]: ...


class LynxKVManager(KVManagerBase):
    # With SGLang's --enable-trace each request's sender gets a trace context under this module
    # name (`--trace-modules lynx` selects it); the prefill's stages become its spans.
    sender_trace_module = "lynx"
    supports_role_switch = False
    supports_deferred_decode_kv_release = False
    # Both ends are Lynx: a prefill-side failure reason (e.g. a codec flag mismatch) travels to
    # the decode in the status message instead of SGLang's generic "prefill might be dead".
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: ServerArgs, is_mla_backend: bool | None = False):
        self.lynx = LynxConfig.from_env() or LynxConfig()
        # Where SGLang's modules are imported (a scheduler): which release this is, and whether
        # every hook Lynx registered in this process is in place, before anything serves.
        check_release(self.lynx.allow_unknown_sglang)
        verify_applied()
        # Again here, not only at CLI parsing: a programmatic launch never passes through it.
        check_anchor_safety(server_args)
        recorder = Recorder.for_process(self.lynx.trace_dir, Metrics(
            server_args.served_model_name or server_args.model_path, disaggregation_mode.value,
            getattr(args, "engine_rank", 0) or 0))
        self.pool: KVPoolView | None = None
        self._stop = threading.Event()
        # Failure reasons this side found itself, by room, until the receiver has read them
        # (`record_failure`).
        self._own_failures: dict[int, str] = {}
        # Before SGLang's constructor: the status threads it starts notify the idle wait, and its
        # `register_buffer_to_engine` builds the staging pool, which records its use.
        self.lynx_runtime = LynxRuntime(idle=IdleWaiter(recorder.metrics), recorder=recorder)
        # Before SGLang's constructor: `_register_topology_row`.
        self.rank_key = RankKey()
        self.registrar = Registrar(self.lynx.load_secret(), self.rank_key)
        self.peer_sockets = PeerSockets()  # before SGLang's constructor: `_connect`
        # Before SGLang's constructor too: its bootstrap thread registers this rank's rows and
        # handles aborts from then on.
        self.role: Role = (PrefillRole(self) if disaggregation_mode == DisaggregationMode.PREFILL
                           else DecodeRole(self, lookup_prefill_rank))
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.role.start(recorder, self._start_thread)
        self.lynx_runtime.idle.report_tracked(self.tracked)
        # The tcp backend's data listener (the verbs backend has none): its events on /metrics.
        listener = getattr(self.endpoint.backend, "listener_counters", None)
        if listener is not None:
            self.lynx_runtime.idle.report_listener(listener)
        logger.info("lynx KV manager (%s) on %s: %s", disaggregation_mode.value,
                    self.endpoint.address, self.lynx)
        started = Trace("server", 0)
        started.mark("started")
        started.facts.update(role=disaggregation_mode.value, address=self.endpoint.address,
                             config=self.lynx.flat())
        recorder.emit(started)

    @property
    def sender(self):
        """The prefill's sender (`backend.prefill.sender.PrefillSender`)."""
        return self.role.sender

    @property
    def applier(self):
        """The decode's applier (`backend.decode.applier.DecodeApplier`)."""
        return self.role.applier

    def tracked(self) -> dict[str, int]:
        """Sizes of this manager's per-request maps, published by `lynx_sglang.idle`."""
        return {**self.role.tracked(), "own_failures": len(self._own_failures)}

    def _start_thread(self, target, name: str) -> None:
        t = threading.Thread(target=target, args=(self._stop,), name=name, daemon=True)
        t.start()
        track_worker_thread(self, t)

    # ---- engine hooks of MooncakeKVManager: the transport replaces Mooncake's engine ---------
    def init_engine(self):
        self.engine = None
        self.endpoint = open_endpoint(self.lynx, self.local_ip, f"lynx-{self.rank_port}",
                                      getattr(self.kv_args, "ib_device", None),
                                      getattr(self.kv_args, "gpu_id", 0) or 0)

    def register_buffer_to_engine(self):
        # Page-locked for a CUDA pool: the encoded chunks' device-to-host copies then overlap
        # the next layer's encode (`lynx_kernels.chunk_copy`).
        self.staging = StagingPool(self.lynx.staging_mib << 20, self.lynx_runtime.recorder.metrics,
                                   pinned=getattr(self.server_args, "device", None) == "cuda")
        self.staging_region = self.endpoint.register(self.staging.buffer, name="lynx-staging")

    def deregister_buffer_to_engine(self):
        self.endpoint.close()

    def get_session_id(self):
        return self.endpoint.address

    def attach_kv_pool(self, pool) -> None:
        """Called (plugin hook) right after SGLang built this manager, with its KV pool: checks
        it, completes the process's runtime with the role's components and attaches that to the
        pool too, where the hooks inside the model and the KV cache find it
        (`runtime.of_kv_pool`)."""
        self.pool = KVPoolView.from_sglang_pool(pool)
        # GPUDirect (registering device memory with the NIC) is not implemented: say so, so an
        # operator comparing with Mooncake knows the encoded bytes leave from host memory.
        logger.info("lynx: staging: %s host memory, %d MiB registered with the %s transport; KV "
                    "pool on %s", "page-locked" if self.staging.pinned else "pageable",
                    self.lynx.staging_mib, self.lynx.transport, self.pool.device)
        self._check_staging_size()
        head_dim = self.pool.shape.head_dim
        if self.lynx.codec.rotate and head_dim & (head_dim - 1):
            # Refuse at start-up rather than failing every request in the codec later.
            raise LynxConfigError(
                f"--lynx-rotate needs a power-of-two head_dim, this model's is {head_dim}: "
                "pass --no-lynx-rotate on prefill and decode"
            )
        self.lynx_runtime = self.role.complete_runtime(self.lynx_runtime)
        runtime.attach(pool, self.lynx_runtime)

    def _check_staging_size(self) -> None:
        """Say at start-up how long a request the staging memory holds whole."""
        rows = int(self.pool.layer(0, KINDS[0]).shape[0])
        log_staging_fit(self.lynx, self.pool.shape, self.staging.nbytes,
                        min(rows, getattr(self.server_args, "context_length", None) or rows))

    def require_pool(self) -> KVPoolView:
        if self.pool is None:
            raise RuntimeError("lynx KV manager has no KV pool attached (plugin hook not applied)")
        return self.pool

    # ---- SGLang's control-plane sockets ------------------------------------------------------
    def _register_topology_row(self, url: str, payload: dict) -> None:
        """SGLang's bootstrap registration of a row (a prefill's): this process's own rows with
        its rank key, authenticated and signed, their leases renewed from then on
        (`PrefillRole.register_row`)."""
        super()._register_topology_row(url, self.role.register_row(url, payload))

    def _connect(self, endpoint: str, is_ipv6: bool = False):
        """SGLang's cached PUSH socket to `endpoint`, after closing the cached sockets of peers
        that have gone (`backend.peer_sockets`: SGLang replaces a dead peer's socket only when
        that endpoint is dialled again, and a restarted decode comes back on a new port)."""
        self.peer_sockets.before_dial(push_sockets(self), keep=endpoint)
        return super()._connect(endpoint, is_ipv6)

    def _make_worker_recv(self, socket, *args, **kwargs):
        """SGLang's receive for a worker thread's socket, as the role watches it
        (`PrefillRole.watch_receive`: the bootstrap thread's aborts for rooms the prefill does not
        know yet, which SGLang's handling drops)."""
        return self.role.watch_receive(super()._make_worker_recv(socket, *args, **kwargs))

    # ---- SGLang's scheduler ------------------------------------------------------------------
    def add_transfer_request(self, bootstrap_room, kv_indices, index_slice, is_last_chunk,
                             aux_index=None, state_indices=None, num_kv_tokens=None, *,
                             wait_event=None, indices_event=None, trace_ctx=None):
        """A prefill's: `PrefillRole.add_transfer_request`."""
        self.role.add_transfer_request(bootstrap_room, kv_indices, is_last_chunk, aux_index,
                                       state_indices, num_kv_tokens, wait_event, indices_event,
                                       trace_ctx)

    def register_rx_room(self, receiver, kv_indices, aux_index: int) -> bool:
        """Called by the receiver (`backend.conn.LynxKVReceiver`) on a decode, before SGLang sends
        the request's metadata to the prefill (`DecodeRole.register_rx_room`).
        False: the room is queued for staging (`DecodeApplier.register`)."""
        return self.role.register_rx_room(receiver, kv_indices, aux_index)

    def update_status(self, bootstrap_room: int, status: KVPoll):
        self.lynx_runtime.idle.notify()
        if not self.role.update_status(bootstrap_room, status, self._sglang_update_status):
            super().update_status(bootstrap_room, status)

    def _sglang_update_status(self, room: int, status: KVPoll) -> None:
        super().update_status(room, status)

    def report_status(self, room: int, failure: str | None) -> None:
        """The one path by which a status this backend decided reaches SGLang."""
        if failure is not None:
            self.record_own_failure(room, failure)
        super().update_status(room, KVPoll.Failed if failure is not None else KVPoll.Success)
        self.lynx_runtime.idle.notify()

    def record_own_failure(self, room: int, reason: str) -> None:
        """Record why this side failed a room; see `record_failure`."""
        with self.failure_lock:
            self._own_failures[room] = reason
            self.failure_records[room] = reason

    def record_failure(self, bootstrap_room: int, failure_reason: str):
        """SGLang's entry for reasons from elsewhere (the prefill's status message, the
        heartbeat). Once the decode has failed a room itself, the prefill usually fails it too
        *because* the decode withdrew it ("no (live) announcement from the peer"); that later
        message must not replace the cause the decode found."""
        with self.failure_lock:
            own = self._own_failures.get(bootstrap_room)
            self.failure_records[bootstrap_room] = own or failure_reason

    def forget_own_failure(self, room: int) -> None:
        with self.failure_lock:
            self._own_failures.pop(room, None)
