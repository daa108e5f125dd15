"""lynx_transport — engine-agnostic two-priority KV transport (Anchor + Residual streams).

Moves bytes between registered memory regions of two processes, tagged (request id, stream).
Never imports SGLang or torch: memory is given as buffer objects or (address, length).

Objects
-------
``Endpoint(backend="tcp", host, port=0, token=None, policy=PriorityPolicy(), checksum=True,
heartbeat_s=0.5, peer_timeout_s=5.0, default_deadline_s=None, backend_options=None)``
    One per process and role. Owns registered regions, a pyzmq control plane bound at
    ``ep.address`` and a data backend: ``"tcp"`` (``lynx_transport.tcp``) or ``"verbs"``
    (``lynx_transport.verbs``, pyverbs RDMA, imported lazily). ``close()`` (or ``with``) stops
    every thread it started.
``ep.register(buf | addr, length=None) -> Region``; ``ep.deregister(region)``
``ep.connect(address, timeout) -> Session`` (blocking handshake) / ``ep.accept(timeout) -> Session``
``Session``: one per peer; either side may receive (announce) and send (write).

Receiver (decode side) ::

    staging = ep.register(np.empty(N, np.uint8))             # pre-registered once, reused
    sess.announce(req, {Stream.ANCHOR: [(staging.id, off_a, len_a)],
                        Stream.RESIDUAL: [(staging.id, off_r, len_r)]}, deadline_s=30)
    st = sess.recv_state(req, Stream.ANCHOR)                 # cheap poll, never blocks
    st = sess.wait(req, Stream.ANCHOR, timeout=0.5)          # or block with a timeout
    if st.ok: ... st.aux (bytes sent with finish()), st.nbytes, st.t_first_byte, st.t_done
    if st.status is Status.FAILED: st.reason (FailureReason.PEER_DIED | TIMEOUT | CORRUPTION |
                                              OUT_OF_BOUNDS | ...), st.detail
    sess.release(req)                                        # withdraw bounds; staging reusable

Sender (prefill side) ::

    src = ep.register(encoded_buffer)                        # e.g. the codec's output staging
    ann = sess.wait_announcement(req, timeout) / sess.announcement(req)   # None until it arrives
    sess.write_stream(req, Stream.ANCHOR, src, src_off, n, stream_offset=0)  # into announced
    sess.write(req, stream, src, src_off, n, dst_region_id, dst_off)        # explicit target
    sess.finish(req, Stream.ANCHOR, aux=first_token_bytes)   # completion notice (+ ≤64 KiB aux)
    sess.write_stream(req, Stream.RESIDUAL, ...); sess.finish(req, Stream.RESIDUAL)
    sess.send_state(req, stream)      # COMPLETE once the receiver acknowledged every byte
    sess.release(req)                 # after this no source byte is read again

Metadata: small per-request data (e.g. the first output token) travels as ``aux`` bytes with a
stream's completion notice (``finish(..., aux=)`` → receiver's ``StreamState.aux``); the
receiver may pass ≤64 KiB ``meta`` with its announcement (``Announcement.meta``).

Buffer ownership
----------------
* The caller owns every registered buffer. A buffer object is kept alive by its Region until
  ``deregister``; a raw address must stay valid until ``deregister`` returns. ``deregister``
  refuses (RegionError) while an unreleased request references the region.
* Receiver staging bytes of a request are written only inside the announced extents, and only
  until the request is released: after ``release(req)`` returns no further byte lands there (also
  true after FAILED). Read them once the stream is COMPLETE; after a failure they are garbage.
  A chunk whose checksum fails may have landed (inside its bounds) before it was verified; the
  stream is then FAILED(CORRUPTION), never COMPLETE.
* Sender source bytes are read until the stream is COMPLETE (the receiver acknowledged them) or
  until ``release(req)`` returns; do not modify or free them before that.

Priority
--------
``PriorityPolicy(mode="strict", residual_share=0.1, chunk_bytes=1 MiB)``: strict — no RESIDUAL
byte is handed to the wire while ANCHOR work is queued for the same peer (a RESIDUAL chunk already
handed to the kernel is not recalled; tcp keeps that small with TCP_NOTSENT_LOWAT); "weighted" —
RESIDUAL gets ``residual_share`` of the bytes while both are backlogged. The tcp backend uses one
socket per stream, marks them with IP_TOS (ANCHOR DSCP EF 0xb8 + SO_PRIORITY 6, RESIDUAL DSCP
CS1 0x20 + SO_PRIORITY 1); the verbs backend uses one RC QP per stream with service levels.
The control plane (pyzmq: heartbeats, announcements, completion notices) is marked IP TOS 0x10
(low delay, Linux priority 6, the ANCHOR's band), so a long ANCHOR on a slow link cannot starve
the heartbeats into a false peer-death verdict.

Safety and faults
-----------------
A peer can only write into regions announced for the request and stream, inside the announced
extents; anything else is refused before a byte lands (the sender also refuses locally) and the
stream fails OUT_OF_BOUNDS / UNKNOWN_REQUEST on both sides. Optional shared-secret ``token`` on the
handshake. Per-chunk checksum (``checksum=True``; tcp: XXH3-64's low 32 bits when both ends
have ``xxhash``, else CRC32). Peer death (socket closed/reset), stalled peers
(no control message for ``peer_timeout_s``) and deadlines fail pending streams with a reason on
both sides; other requests on the session are unaffected by per-request failures.
"""

from .backend import BACKENDS, Backend, FinOp, PriorityPolicy, Refused, WriteOp, load_backend
from .endpoint import Endpoint
from .memory import Region
from .session import Session
from .types import (
    MAX_AUX_BYTES,
    STREAMS,
    Announcement,
    BackendUnavailableError,
    Extent,
    FailureReason,
    HandshakeError,
    OutOfBoundsError,
    RegionError,
    SessionClosedError,
    Status,
    Stream,
    StreamState,
    StreamStateError,
    TransportError,
    UnknownRequestError,
)

__all__ = [
    "BACKENDS",
    "MAX_AUX_BYTES",
    "STREAMS",
    "Announcement",
    "Backend",
    "BackendUnavailableError",
    "Endpoint",
    "Extent",
    "FailureReason",
    "FinOp",
    "HandshakeError",
    "OutOfBoundsError",
    "PriorityPolicy",
    "Refused",
    "Region",
    "RegionError",
    "Session",
    "SessionClosedError",
    "Status",
    "Stream",
    "StreamState",
    "StreamStateError",
    "TransportError",
    "UnknownRequestError",
    "WriteOp",
    "load_backend",
]
