"""Closing SGLang's cached control-plane sockets to peers that have gone.

SGLang's KV manager keeps one PUSH socket (and a disconnect monitor) per peer endpoint, and
replaces one only when that endpoint is dialled again: a peer that comes back on a new port (every
decode restart) left its socket and monitor behind for the life of the process, 3 fds each
(measured: +3 fds on the prefill per decode restart, with mooncake_tcp as with lynx).
`LynxKVManager._connect` calls `close_departed_peers` before each dial, on the caller's thread.
"""

from __future__ import annotations

import logging
import threading

import zmq

logger = logging.getLogger(__name__)


def close_departed_peers(lock: threading.Lock, sockets: dict, monitors: dict, send_locks: dict,
                         keep: str) -> None:
    """Close the cached socket and monitor of every endpoint but `keep` whose monitor reported a
    disconnect. The maps are SGLang's (`_socket_cache`, `_monitor_cache`, `_socket_send_locks`),
    guarded by its `_socket_lock`."""
    with lock:
        for endpoint, monitor in list(monitors.items()):
            if endpoint == keep:
                continue  # SGLang's own check replaces it
            send_lock = send_locks.get(endpoint)
            # Checked before the monitor is read, since reading consumes the event: a socket that
            # is sending now is left for the next call.
            if send_lock is None or not send_lock.acquire(blocking=False):
                continue
            try:
                if not _disconnected(monitor):
                    continue
                sockets.pop(endpoint).close(linger=0)
                monitors.pop(endpoint).close()
                logger.info("lynx: closed SGLang's socket to %s (the peer disconnected)", endpoint)
            finally:
                send_lock.release()


def _disconnected(monitor) -> bool:
    """Whether a socket's monitor (SGLang subscribes it to disconnects only) has reported one."""
    try:
        monitor.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError:
        pass
    return True
