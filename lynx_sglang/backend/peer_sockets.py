"""Closing SGLang's cached control-plane sockets to peers that have gone.

SGLang's KV manager keeps one PUSH socket (and a disconnect monitor) per peer endpoint, and
replaces one only when that endpoint is dialled again: a peer that comes back on a new port (every
decode restart) left its socket and monitor behind for the life of the process, 3 fds each
(measured: +3 fds on the prefill per decode restart, with mooncake_tcp as with lynx).

A socket dialled to a peer that is already dead is the case the monitor cannot see: SGLang sets
`RECONNECT_IVL` -1 and watches `EVENT_DISCONNECTED` only, and zmq reports a connection that never
came up as `EVENT_CLOSED`, which nobody reads (and sends to it still "succeed"). A prefill whose
decode died before the room's status went out dials it exactly so: the fault matrix's
`decode/sigkill/before-anchor` and `mid-anchor` cells left 3 fds each. So a cached socket unused
for `IDLE_CLOSE_S` is closed too, whatever its monitor says; SGLang dials again on the next
message.

`LynxKVManager._connect` calls `PeerSockets.before_dial` before each dial, on the caller's thread.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:  # the module imports SGLang: this one is read without it
    from ..upstream.kv_transfer import PushSockets

logger = logging.getLogger(__name__)

# A status message is a few hundred bytes: to a reachable peer it left the socket within
# milliseconds, so closing (linger 0) a socket idle this long loses nothing a peer could still
# receive.
IDLE_CLOSE_S = 60.0


class PeerSockets:
    """When each of SGLang's cached sockets was last dialled, and the closing of those whose peer
    has gone (disconnected, or idle past `idle_close_s`). Guarded by the sockets' lock."""

    def __init__(self, idle_close_s: float = IDLE_CLOSE_S) -> None:
        self.idle_close_s = idle_close_s
        self._dialled: dict[str, float] = {}

    def before_dial(self, cached: PushSockets, keep: str) -> None:
        """Record that `keep` is dialled now; close the cached socket and monitor of every other
        endpoint whose monitor reported a disconnect or that has not been dialled for
        `idle_close_s`. `cached`: SGLang's manager's maps (`upstream.kv_transfer.push_sockets`),
        guarded by its lock."""
        now = time.monotonic()
        sockets, monitors, send_locks = cached.sockets, cached.monitors, cached.send_locks
        with cached.lock:
            self._dialled[keep] = now
            for endpoint in list(sockets):
                if endpoint == keep:
                    continue  # SGLang's own check replaces it
                send_lock = send_locks.get(endpoint)
                # Checked before the monitor is read, since reading consumes the event: a socket
                # that is sending now is left for the next call.
                if send_lock is None or not send_lock.acquire(blocking=False):
                    continue
                try:
                    idle = now - self._dialled.setdefault(endpoint, now)
                    why = (f"unused for {idle:.0f} s" if idle >= self.idle_close_s
                           else "the peer disconnected" if _disconnected(monitors.get(endpoint))
                           else None)
                    if why is None:
                        continue
                    sockets.pop(endpoint).close(linger=0)
                    monitor = monitors.pop(endpoint, None)
                    if monitor is not None:
                        monitor.close()
                    logger.info("lynx: closed SGLang's socket to %s (%s)", endpoint, why)
                finally:
                    send_lock.release()
            for endpoint in [e for e in self._dialled if e not in sockets and e != keep]:
                del self._dialled[endpoint]


def _disconnected(monitor) -> bool:
    """Whether a socket's monitor (SGLang subscribes it to disconnects only) has reported one."""
    if monitor is None:
        return False
    try:
        monitor.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError:
        pass
    return True
