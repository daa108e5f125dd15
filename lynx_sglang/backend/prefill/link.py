"""The prefill's interface with SGLang's side of the manager (`backend.manager.LynxKVManager`):
what the sender asks it (`PrefillLink`, `Destination`) and what SGLang reads back after a room's
Success (`SentBytes`). Built by the manager; used by `backend.prefill.sender.PrefillSender` and its
destination workers (`backend.prefill.worker`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import SettingsMismatchError
from ..heads import head_range

# Rooms whose sent-byte count waits for SGLang to read it (it reads right after Success).
SENT_BYTES_KEPT = 4096


@dataclass(frozen=True)
class Destination:
    """One decode rank a room goes to: its transport address, how many KV pages it allocated
    (slots at page size 1; `backend.pages`), SGLang's (endpoint, port) to notify, and which of
    this rank's KV heads it holds ((first, count) when its attention TP size is larger:
    `backend.heads`; None: all) or why it cannot be sent to (`refusal`)."""

    session_address: str
    num_pages: int
    notify: tuple[str, int]
    heads: tuple[int, int] | None = None
    refusal: str | None = None


def destination_of(info, peer, prefill_tp: int, prefill_rank: int, total_heads: int, *,
                   latent: bool = False) -> Destination:
    """SGLang's transfer info of one decode rank (`info`) as the sender's `Destination`, with the
    KV heads that rank holds when its attention TP size differs, read from its KV-args
    registration (`peer`, None if it has not registered), as SGLang's Mooncake backend slices
    them. An MLA pool (`latent`) has no heads to slice: every TP rank holds the whole latent, and
    SGLang has each decode rank read it from one prefill rank (the others are its dummies)."""
    heads, refusal = None, None
    decode_tp = prefill_tp if peer is None else int(peer.dst_attn_tp_size)
    if decode_tp != prefill_tp and not latent:
        try:
            heads = head_range(prefill_tp, decode_tp, prefill_rank, int(peer.dst_tp_rank),
                               total_heads)
        except SettingsMismatchError as exc:
            refusal = str(exc)
    return Destination(info.mooncake_session_id, len(info.dst_kv_indices),
                       (info.endpoint, info.dst_port), heads, refusal)


@dataclass(frozen=True)
class PrefillLink:
    """What the sender needs from SGLang's side of the manager (all thread-safe callables)."""

    # False once SGLang has failed or cleared the room: drop its work.
    is_live: Callable[[int], bool]
    # The room's decode destinations (dummy ranks excluded).
    destinations: Callable[[int], list[Destination]]
    # SGLang's aux data of the room (first output token, ...), packed for the wire.
    read_aux: Callable[[int], bytes]
    # The one status report: (room, None | failure reason, notify targets).
    report: Callable[[int, str | None, list[tuple[str, int]]], None]


class SentBytes:
    """Bytes each successful room put on the wire, for SGLang's transfer metrics: recorded by the
    destination worker before it reports Success, read once by SGLang (`take`). Capped, since an
    aborted request's entry is never read. Thread-safe."""

    def __init__(self) -> None:
        self._bytes: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, room: int, nbytes: int) -> None:
        with self._lock:
            self._bytes[room] = nbytes
            while len(self._bytes) > SENT_BYTES_KEPT:
                self._bytes.popitem(last=False)

    def take(self, room: int) -> int | None:
        """The Anchor + Residual bytes sent for `room` (every destination), once; None if the
        room was not sent (failed, or already taken)."""
        with self._lock:
            return self._bytes.pop(room, None)
