"""lynx_transport — engine-agnostic two-priority KV transport (Anchor + Residual streams).

Moves bytes between registered memory regions of two processes, tagged (request id, stream).
Never imports SGLang or torch: memory is given as buffer objects or (address, length).

Objects
-------
``Endpoint(backend="tcp", host, port=0, secret=None, allow_insecure=False, policy=PriorityPolicy(),
checksum=True, heartbeat_s=0.5, peer_timeout_s=5.0, default_deadline_s=None, backend_options=None,
limits=Limits(), name="")``
    One per process and role. Owns registered regions, a pyzmq control plane bound at
    ``ep.address`` and a data backend: ``"tcp"`` (``lynx_transport.tcp``) or ``"verbs"``
    (``lynx_transport.verbs``, pyverbs RDMA, imported lazily). ``close()`` (or ``with``) stops
    every thread it started. ``secret``: the bytes every endpoint of a deployment shares (see
    Security); required unless ``host`` is a loopback address or ``allow_insecure=True``.
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
``PriorityPolicy(mode="strict", residual_share=0.1, chunk_bytes=1 MiB, link_order=False)``:
strict — no RESIDUAL byte is handed to the wire while ANCHOR work is queued for the same peer (a
RESIDUAL chunk already handed to the kernel is not recalled; tcp keeps that small with
TCP_NOTSENT_LOWAT); with ``link_order`` (tcp) a request whose RESIDUAL is later than its byte
bound by more than newer requests' queued ANCHOR bytes take on the link goes before them
(``lynx_transport.link_order``); "weighted" — RESIDUAL gets ``residual_share`` of the bytes
while both are backlogged. The tcp backend uses one
socket per stream, marks them with IP_TOS (ANCHOR DSCP EF 0xb8 + SO_PRIORITY 6, RESIDUAL DSCP
CS1 0x20 + SO_PRIORITY 1); the verbs backend uses one RC QP per stream with service levels.
The control plane (pyzmq: heartbeats, announcements, completion notices) is marked IP TOS 0x10
(low delay, Linux priority 6, the ANCHOR's band), so a long ANCHOR on a slow link cannot starve
the heartbeats into a false peer-death verdict.

Safety and faults
-----------------
A peer can only write into regions announced for the request and stream, inside the announced
extents; anything else is refused before a byte lands (the sender also refuses locally; tcp checks
every chunk before reading its payload, verbs registers each announced extent on its own so that
the NIC refuses a write beyond it) and the stream fails OUT_OF_BOUNDS / UNKNOWN_REQUEST on both
sides. Per-chunk checksum (``checksum=True``; tcp: XXH3-64's low 32 bits when both ends have
``xxhash``, else CRC32; verbs: CRC32); a receiver with ``checksum=True`` refuses chunks without one.
Peer death (socket closed/reset), stalled peers (no authenticated control message for
``peer_timeout_s``) and deadlines fail pending streams with a reason on both sides; other requests
on the session are unaffected by per-request failures.

Security
--------
Threat model: anyone who can reach an endpoint's ports may send it anything. The transport must
not let such a peer open a session, write a byte, allocate without bound, stop a thread that
serves others, or disturb another peer's session; an *authenticated* peer (one that holds the
secret) must stay inside what was announced to its own session. Confidentiality and integrity of
the KV bytes against an attacker on the path: the tcp backend's TLS (``backend_options={"tls":
TlsConfig(...)}``, `lynx_transport.tls`: TLS 1.3 on every data connection, certificates checked
both ways); without it the data connections carry checksums, not MACs, and travel in clear. Not
covered: confidentiality of the control messages without a secret (authenticated, in clear; they
carry ids, sizes and settings, no stream bytes; with a secret CURVE encrypts them), the verbs
backend's bytes (use a fabric only the cluster
reaches), and denial of service by exhausting the network or file descriptors (a connection that
has not authenticated holds one fd until its deadline: ``Limits.auth_timeout_s`` on the control
port, ``preamble_timeout_s`` on the tcp data listener). The caps on what unauthenticated peers
hold never refuse a newcomer: it evicts an older pending handshake or data connection (its own
address's oldest at that address's cap, else the oldest of the address holding the most; on the
data listener a candidate whose preamble has arrived is attached instead of evicted, and addresses
that never completed a preamble go first), so peers that never authenticate, from any number of
addresses, cannot lock an honest one out. The data listener closes only the connection whose
handling failed and restarts its loop should it fail as a whole (``listener_restarts``). Each
session has a channel binding both ends know (``Session.channel_binding``): what the layer above
signs so that a claim made on one session is worth nothing on another.

Protocol (version 2; an endpoint refuses any other version at connect, naming both):

0. The control connection. With a secret every zmq connection runs CURVE (libzmq's CurveZMQ): the
   acceptor's ROUTER is a CURVE server whose key is derived from the secret
   (``lynx_transport.auth.control_key``), and since CurveZMQ never sends the server's public key,
   only a peer holding the secret completes the ZMTP handshake; nothing anyone else sends is
   buffered or reaches the control thread. The initiator watches its DEALER until the handshake
   ends and reports a failed one at once ("do not share the same secret (or one has none)"); the
   acceptor does not count them (libzmq drops them). Without a secret: ZMTP's NULL mechanism. A
   connection whose ZMTP handshake is not done within ``handshake_timeout_s`` is closed.
   (Endpoints with a secret from before CURVE speak NULL: they and these cannot reach each other.)
1. HELLO, initiator → acceptor: session id (16 random bytes), version, backend, nonce_i (32
   random bytes). The acceptor keeps a small pending record — no thread, no backend resource —
   within its caps (`Limits`: HELLOs per second per address; handshakes in progress, in all and
   per address, where a newcomer evicts an older record rather than being refused; sessions) and
   drops it after ``auth_timeout_s``.
2. CHALLENGE, acceptor → initiator: nonce_a. Both ends derive the session keys:
   ``K = HMAC-SHA256(secret, "lynx-transport/2 session\0" ‖ sid ‖ nonce_i ‖ nonce_a)``, and from it
   ``K_i = HMAC(K, "initiator")``, ``K_a = HMAC(K, "acceptor")``, ``K_data = HMAC(K, "data")``.
   The secret never crosses the wire.
3. AUTH, initiator → acceptor: its backend info and per-session prepare, MACed with K_i. A valid
   MAC proves the initiator holds the secret; only now does the acceptor create backend resources
   and start one (bounded) bring-up thread. A bad MAC is answered REJECT ("do not share the same
   secret").
4. WELCOME, acceptor → initiator: its backend info and prepare, MACed with K_a (proves the
   acceptor holds the secret too), then READY both ways and the session is up.

Every message after the CHALLENGE carries a fourth frame: a sequence number (per direction,
starting at 1, strictly increasing) and HMAC-SHA256(K_dir, seq ‖ each frame length-prefixed:
kind, JSON header with the session id, payload), checked before the message is parsed or
dispatched: a forged, altered, replayed, reordered or reflected message is dropped and counted
(``Endpoint.stats()``: ``control_bad_mac``, ``control_replayed``). A session is bound to the
connection it was created on (the ROUTER routing id on the acceptor, the session's own DEALER on
the initiator): a message naming it from any other connection is dropped (``control_wrong_route``).
HELLO, CHALLENGE and REJECT are unauthenticated; a REJECT is heeded only before the WELCOME.
tcp data connections open with ``HMAC(K_data, "lynx-transport/2 tcp data\0" ‖ sid ‖ stream)``: only
the two ends of the handshake can attach a stream to the session. Without a secret the same
protocol runs with an empty one: messages stay bound to their session and connection, but anyone
can compute the keys — hence the loopback-only rule. The secret must be random (≥ 16 bytes): a
recorded handshake lets a guessable secret be found offline. Whoever holds the secret and sees a
handshake can derive that session's keys.

With TLS a data connection's TLS handshake comes first (in the listener's selector, under the
preamble deadline; a failed one is counted, ``tls_handshakes_failed``), then the preamble inside
it; each connection carries one direction (``lynx_transport.tls`` says why).

Every field a peer sends is checked before use (``lynx_transport.wire``; a bad message is counted
and dropped, never raised into a thread). Caps: `Limits` (sessions, handshakes, HELLO rate,
bring-up threads, a session's pending announcements, zmq frame size) and the tcp listener's
preamble deadline and pending-connection caps (``lynx_transport.tcp_accept``). Known limit: libzmq bounds
each frame (ZMQ_MAXMSGSIZE, ``Limits.max_message_bytes``) but not the number of frames of one
message, and it buffers every frame of a message until its last one arrives (pyzmq never sees a
part of it). So a peer that completes the ZMTP handshake and never ends a multipart message makes
the endpoint's libzmq buffer it until the connection closes: ~64 B per empty frame, each frame's
bytes otherwise; measured on loopback, +300 MiB in 1.3 s. With a secret only holders of the secret
complete that handshake (step 0); without one (loopback only, unless ``allow_insecure``) any local
process can.
"""

from .backend import BACKENDS, Backend, FinOp, PriorityPolicy, Refused, WriteOp, load_backend
from .endpoint import Endpoint
from .limits import Limits
from .memory import Region
from .session import Session
from .types import (
    MAX_AUX_BYTES,
    STREAMS,
    Announcement,
    AnnouncementTimeoutError,
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
    "AnnouncementTimeoutError",
    "Backend",
    "BackendUnavailableError",
    "Endpoint",
    "Extent",
    "FailureReason",
    "FinOp",
    "HandshakeError",
    "Limits",
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
