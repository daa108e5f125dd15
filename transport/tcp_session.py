"""`TcpSession`: the `tcp` backend's state of one session's data path.

Owned by `tcp.TcpBackend` (which creates, connects and closes it); shared, under its `lock`, by
the session's sender thread (`tcp_send.SendLoop`: queues, current chunks, sent bytes, the link
order) and its receiver threads (`tcp_recv.RecvLoop`: received bytes), which all leave once `stop` is set.
"""

from __future__ import annotations

import collections
import socket
import threading
from dataclasses import dataclass, field

from .link_order import LinkOrder
from .types import STREAMS


@dataclass
class TcpSession:
    sid: bytes
    initiator: bool
    key: bytes  # the session's data key: its data connections prove it
    socks: dict = field(default_factory=dict)  # channel (preamble) -> socket, every connection
    tx: dict = field(default_factory=dict)  # Stream -> the socket this end sends that stream on
    rx: dict = field(default_factory=dict)  # Stream -> the socket this end receives it on
    # Stream -> deque of tcp_send.QueuedOp; Stream -> the tcp_send.Chunk being sent, or None
    queues: dict = field(default_factory=lambda: {s: collections.deque() for s in STREAMS})
    current: dict = field(default_factory=lambda: {s: None for s in STREAMS})
    lock: threading.Condition = field(default_factory=threading.Condition)
    stop: bool = False
    threads: list = field(default_factory=list)
    # the sender's wake pipe: a byte written to wake_w ends its poll early (new work, close)
    wake_r: socket.socket | None = None
    wake_w: socket.socket | None = None
    connected: threading.Event = field(default_factory=threading.Event)
    sent_bytes: dict = field(default_factory=lambda: {s: 0 for s in STREAMS})
    recv_bytes: dict = field(default_factory=lambda: {s: 0 for s in STREAMS})
    # PriorityPolicy.link_order: the order across the session's requests (changed under `lock`)
    order: LinkOrder | None = None
    use_xxh3: bool = False
    peer_requires_checksum: bool = True  # what the peer's local_info says; until then: safe side
