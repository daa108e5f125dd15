"""`Endpoint`: one per process and role — registered regions, sessions, the backend.

See the package docstring (`lynx_transport.__doc__`) for the API walk-through and buffer ownership.
The Endpoint is the user's face: it owns the registered regions and their reference counts, the
data backend (and `_BackendHooks`, through which the backend reports to the sessions), the
accept queue, the counters behind `stats()`, the security settings (secret, `Limits`; refusing to
listen beyond loopback without a secret), and it opens sessions (`connect`, the initiator's
handshake) and closes everything. The control plane is `control.ControlPlane`; per-peer state and
message handling are `session.Session`'s. Sessions use the Endpoint through
`sessionbase.SessionHost` (`region`, `find_region`, `region_refs`, `count` and a few settings).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .auth import NO_SECRET, SESSION_ID_BYTES, check_exposure, check_secret
from .backend import Backend, PriorityPolicy, Refused, load_backend
from .control import ControlPlane
from .limits import Limits
from .memory import Region, describe_buffer
from .receiver import IncomingChunk
from .session import Session
from .types import (
    FailureReason,
    HandshakeError,
    RegionError,
    SessionClosedError,
    Stream,
    TransportError,
)


class Endpoint:
    """One transport endpoint: registered regions + control plane + a data backend.

    Endpoint(backend="tcp", host="127.0.0.1", port=0, secret=None, allow_insecure=False,
             policy=PriorityPolicy(), checksum=True, heartbeat_s=0.5, peer_timeout_s=5.0,
             default_deadline_s=None, backend_options=None, limits=Limits(), name="")

    `address` is the control-plane address peers pass to `connect`. Use as a context manager or
    call `close()`; close joins every thread it started.

    `secret`: bytes (at least 16, random) every endpoint of the deployment shares; sessions are
    opened only between endpoints holding the same secret (see the package docstring,
    "Security"). Without one, `host` must be a loopback address unless `allow_insecure=True`.
    `checksum`: chunks sent carry a checksum, and chunks received must carry one.
    `limits`: caps on what peers can make this endpoint hold (`lynx_transport.Limits`).
    """

    def __init__(
        self,
        backend: str = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes | None = None,
        allow_insecure: bool = False,
        policy: PriorityPolicy | None = None,
        checksum: bool = True,
        heartbeat_s: float = 0.5,
        peer_timeout_s: float = 5.0,
        default_deadline_s: float | None = None,
        backend_options: dict | None = None,
        limits: Limits | None = None,
        name: str = "",
        _unsafe_skip_bounds: bool = False,
    ) -> None:
        secret = check_secret(secret)
        check_exposure(host, secret, allow_insecure)
        self.host = host
        self.name = name or f"ep-{os.getpid()}"
        self.id = os.urandom(8).hex()
        self.limits = limits or Limits()
        self.policy = policy or PriorityPolicy()
        self.checksum = checksum
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.default_deadline_s = default_deadline_s
        self.unsafe_skip_bounds = _unsafe_skip_bounds  # tests only: lets bad writes reach peers
        self._regions: dict[int, Region] = {}
        self._region_users: dict[int, int] = {}
        self._region_ids = itertools.count(1)
        self._accepted: queue.Queue[Session] = queue.Queue()
        self._lock = threading.RLock()
        self._counters: dict[str, int] = {}
        self._closed = False
        self._on_progress: Callable[[], None] | None = None

        backend_cls = load_backend(backend)
        self.backend_name = backend
        self.backend: Backend = backend_cls(_BackendHooks(self._session), host, self.policy,
                                            dict(backend_options or {}), checksum)
        self.backend_counts_incoming = getattr(self.backend, "counts_incoming", True)

        try:
            self._control = ControlPlane(
                host, port, self.name, secret=NO_SECRET if secret is None else secret,
                endpoint_id=self.id, backend=self.backend, backend_name=backend,
                limits=self.limits, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                new_session=self._new_session, on_accepted=self._accepted.put, count=self.count,
            )
        except BaseException:
            self.backend.close()
            raise
        self.port = self._control.port
        self.address = self._control.address
        self._control.start()

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.name} {self.backend_name} {self.address}>"

    # ------------------------------------------------------------------ regions
    def register(self, buf: Any, length: int | None = None, *, name: str = "") -> Region:
        """Register local memory: a buffer object (numpy array, bytearray, memoryview, mmap; must
        be C-contiguous) or an integer address with `length`. Returns the Region (use `.id` in
        announcements, the object itself as a write source). The caller keeps owning the memory:
        it must stay valid until `deregister` returns (buffer objects are kept alive meanwhile).
        """
        addr, n, writable, owner = describe_buffer(buf, length)
        with self._lock:
            rid = next(self._region_ids)
            region = Region(rid, addr, n, writable, name, owner)
            region.backend_info = dict(self.backend.register_region(region) or {})
            self._regions[rid] = region
            self._region_users[rid] = 0
        return region

    def deregister(self, region: Region | int) -> None:
        """Undo `register`. Raises RegionError while an announcement or an unreleased sent request
        still references the region (release those requests first)."""
        rid = region.id if isinstance(region, Region) else int(region)
        with self._lock:
            r = self._regions.get(rid)
            if r is None:
                raise RegionError(f"region {rid} is not registered")
            if self._region_users.get(rid, 0) > 0:
                raise RegionError(f"region {rid} is still referenced by "
                                  f"{self._region_users[rid]} unreleased request(s)")
            del self._regions[rid]
            del self._region_users[rid]
        self.backend.deregister_region(r)

    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    # ---- for sessions (sessionbase.SessionHost)
    def region(self, rid: int) -> Region:
        """The registered region `rid`; RegionError if there is none."""
        try:
            return self._regions[rid]
        except KeyError:
            raise RegionError(f"region {rid} is not registered") from None

    def find_region(self, rid: int) -> Region | None:
        return self._regions.get(rid)

    def region_refs(self, rids: Iterable[int], delta: int) -> None:
        """Add `delta` to the reference count of each region in `rids` (deregister refuses while
        one is referenced); regions no longer registered are skipped."""
        with self._lock:
            for rid in rids:
                rid = int(rid)
                if rid in self._region_users:
                    self._region_users[rid] = max(0, self._region_users[rid] + delta)

    def count(self, key: str, n: int = 1) -> None:
        """Add `n` to the counter `key` of `stats()`."""
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + n

    def on_progress(self, listener: Callable[[], None] | None) -> None:
        """Call `listener()` whenever bytes land in, or a receive stream of, any session of this
        Endpoint changes (chunk landed, stream complete, stream failed), so a consumer can block
        on its own event instead of polling `recv_state`. It runs on the transport's threads: it
        must be quick and must not call back into the transport (e.g. `threading.Event.set`).
        An exception it raises is counted (`progress_listener_errors`) and otherwise ignored."""
        self._on_progress = listener

    def progress(self) -> None:
        listener = self._on_progress
        if listener is None:
            return
        try:
            listener()
        except Exception:
            self.count("progress_listener_errors")

    # ------------------------------------------------------------------ sessions
    def connect(self, address: str, timeout: float = 10.0) -> Session:
        """Open a session to the Endpoint at `address` (its `.address`). Blocks until the data
        path is up on both sides or raises HandshakeError after `timeout` s (also when the peer
        refuses: another secret, protocol version or backend; busy)."""
        self._check_open()
        s = self._new_session(os.urandom(SESSION_ID_BYTES), True, address)
        end = time.monotonic() + timeout
        try:
            self._control.open(s, address)
            if not s.wait_challenge(end):
                raise HandshakeError(f"no answer from {address} within {timeout} s (not running, "
                                     "unreachable, or dropping our HELLOs: it rate-limits them "
                                     "per address)")
            if s.handshake_error is None:
                s.authenticate(self.backend.local_info(),
                               self.backend.session_prepare(s.id, True, s.data_key))
                if not s.wait_welcome(end):
                    raise HandshakeError(f"{address} did not accept the session within {timeout} s")
            if s.handshake_error is not None:
                raise HandshakeError(f"{address} refused the session: {s.handshake_error}")
            try:
                self.backend.session_connect(s.id, s.remote_info, s.remote_prepare, True,
                                             max(0.1, end - time.monotonic()))
            except HandshakeError as exc:
                if s.closed and s.close_detail:  # the peer refused first: its reason
                    raise HandshakeError(f"{address} closed the session: {s.close_detail}") from exc
                raise
            s.data_path_up()
            ready = s.wait_peer_ready(end)
            s.check_open()
            if not ready:
                raise HandshakeError(f"{address} did not become ready within {timeout} s")
            return s
        except Exception as exc:
            s.terminate(FailureReason.CLOSED, f"connect failed: {exc}", notify=True)
            if isinstance(exc, TransportError):
                raise
            raise HandshakeError(f"connect to {address} failed: {exc}") from exc

    def accept(self, timeout: float | None = None) -> Session | None:
        """Next session a peer opened to this endpoint (ready to use), or None after `timeout`."""
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def sessions(self) -> list[Session]:
        return [s for s in self._control.sessions() if not s.closed]

    def stats(self) -> dict:
        """Counters (among them what peers sent that was refused: `control_*`, `hello_*`,
        `handshake_*`), gauges (`sessions_open`, `handshakes_pending`) and the backend's."""
        with self._lock:
            out = dict(self._counters)
        out["sessions_open"] = len(self._control.sessions())
        out["handshakes_pending"] = self._control.handshakes_pending()
        out["backend"] = self.backend.stats()
        return out

    def _new_session(self, sid: bytes, initiator: bool, peer_address: str) -> Session:
        return Session(self, self._control, sid, initiator, peer_address)

    def _session(self, sid: bytes) -> Session | None:
        return self._control.session(sid)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("endpoint closed")

    # ------------------------------------------------------------------ close
    def close(self, timeout: float = 5.0) -> None:
        """Close every session (peers are told), stop the control thread and the backend."""
        if self._closed:
            return
        for s in self._control.sessions():
            s.terminate(FailureReason.CLOSED, "endpoint closed", notify=True)
        self._closed = True
        self._control.stop(timeout)
        try:
            self.backend.close()
        finally:
            self._control.close()


class _BackendHooks:
    """The `backend.BackendHooks` of one Endpoint: hands each callback to the session it names
    (`session` looks a session up by id; None once it is gone)."""

    def __init__(self, session: Callable[[bytes], Session | None]):
        self._session = session

    def open_incoming(self, session_id: bytes, request_id: int, stream: Stream, region_id: int,
                      offset: int, length: int) -> IncomingChunk:
        s = self._session(session_id)
        if s is None:
            raise Refused(FailureReason.CLOSED, "session closed")
        return s.open_incoming(request_id, stream, region_id, offset, length)

    def incoming_fin(self, session_id: bytes, request_id: int, stream: Stream, total: int,
                     aux: bytes | None) -> None:
        s = self._session(session_id)
        if s is not None:
            s.incoming_fin(request_id, Stream(stream), total, aux)

    def sent(self, session_id: bytes, request_id: int, stream: Stream, nbytes: int) -> None:
        s = self._session(session_id)
        if s is not None:
            s.on_sent(request_id, Stream(stream), nbytes)

    def send_failed(self, session_id: bytes, request_id: int, stream: Stream,
                    reason: FailureReason, detail: str = "") -> None:
        s = self._session(session_id)
        if s is not None:
            s.abort_request(request_id, Stream(stream), reason, detail, notify=True)

    def session_lost(self, session_id: bytes, reason: FailureReason, detail: str = "") -> None:
        s = self._session(session_id)
        if s is not None:
            s.terminate(reason, detail, notify=True)
