"""SGLang's transfer-backend interface as Lynx's backend (`backend.conn`, `backend.manager`) meets
it: the base classes Lynx's KV manager, sender, receiver and bootstrap server derive from, the
enums and records SGLang hands them, and accessors for the private state of SGLang's Mooncake
manager that Lynx's manager must reach (its cached control sockets, its worker threads).

Imported when the backend's classes are, in a process that selected `--disaggregation-transfer-
backend lynx` (SGLang's `get_kv_class`, hooked by `lynx_sglang.plugin`); importing it imports
SGLang's disaggregation modules. Which class a Lynx class derives from where releases differ is
`upstream.adapter`'s to decide; every overridden method is listed in `hook_table.SUBCLASSED` and
fingerprinted per release.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVReceiver
from sglang.srt.disaggregation.common.utils import AuxDataCodec
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from . import adapter

__all__ = [
    "ABORT_TAG", "AuxDataCodec", "BootstrapServerBase", "DisaggregationMode", "KVArgs",
    "KVManagerBase", "KVPoll", "KVReceiverBase", "KVSenderBase", "KVTransferMetric",
    "PushSockets", "ServerArgs", "disconnect_push_endpoint", "push_sockets",
    "track_worker_thread",
]

# Lynx keeps Mooncake's control plane (bootstrap, KV-args registration, status messages,
# heartbeats) and replaces its data path, so its manager is a Mooncake manager.
KVManagerBase = MooncakeKVManager
KVSenderBase = adapter.transfer().kv_sender_base
KVReceiverBase = adapter.transfer().kv_receiver_base
BootstrapServerBase = CommonKVBootstrapServer
# The first frame of a decode's abort notification (no SGLang constant in every release).
ABORT_TAG = adapter.transfer().abort_tag


@dataclass(frozen=True)
class PushSockets:
    """The Mooncake manager's cache of PUSH sockets to its peers, by endpoint: the sockets, their
    disconnect monitors and per-socket send locks, all guarded by `lock` (SGLang's private
    `_socket_lock`, `_socket_cache`, `_monitor_cache`, `_socket_send_locks`)."""

    lock: threading.Lock
    sockets: dict
    monitors: dict
    send_locks: dict


def push_sockets(manager: MooncakeKVManager) -> PushSockets:
    """`manager`'s cached PUSH sockets (see `PushSockets`)."""
    return PushSockets(manager._socket_lock, manager._socket_cache, manager._monitor_cache,
                       manager._socket_send_locks)


def track_worker_thread(manager: MooncakeKVManager, thread: threading.Thread) -> None:
    """Add a started thread to the ones SGLang's manager keeps (`_worker_threads`)."""
    manager._worker_threads.append(thread)


def disconnect_push_endpoint(host: str, port: int) -> None:
    """Close the receivers' shared PUSH socket to a prefill rank, as SGLang's node-failure handler
    does (`CommonKVReceiver.disconnect_endpoint`)."""
    CommonKVReceiver.disconnect_endpoint(NetworkAddress(host, port).to_tcp())
