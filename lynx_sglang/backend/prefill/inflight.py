"""The prefill staging ranges one destination worker holds (`InFlightStaging`): allocated for a
room (or a windowed room's segment) before its encode, handed to the transport with its streams,
freed once the transport has delivered both (`reap`) or when the streams fail before they were
all written (`undo`).

Owned by a `backend.prefill.worker.DestinationWorker` (one each; only its thread calls it);
its room writers (`backend.prefill.writer`) encode into the ranges. Buffer ownership: a range is
the worker's from `allocate` until `reap` or `undo` frees it, after `Session.release` guarantees
no byte of it is read again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lynx_transport import Session, Stream, TransportError, UnknownRequestError

from ...config import LynxConfig
from ...errors import StagingFullError
from ...recorder import Recorder
from ...trace import Trace
from ..staging import StagingPool, StagingRange
from .stream_policy import StreamPolicy

logger = logging.getLogger(__name__)

# How often a room waiting for prefill staging reaps its worker's delivered rooms.
STAGING_POLL_S = 0.05


@dataclass
class InFlight:
    """A sent room (or a windowed room's segment, by its request id) whose staging range must
    live until the transport has delivered it. `trace`: the record to complete and emit then
    (None for a windowed room's segments but its last)."""

    room: int
    session: Session
    staging: StagingRange
    trace: Trace | None
    # Sent after its forward: the decode's session address and when the room was ready to send
    # (monotonic), whose Anchor delivery then measures that link (`StreamPolicy.observe_anchor`).
    decode: str | None = None
    ready_at: float | None = None


class InFlightStaging:
    """One worker's staging ranges in the transport's hands (see the module)."""

    def __init__(self, staging: StagingPool, config: LynxConfig, recorder: Recorder,
                 stream_policy: StreamPolicy | None = None):
        self.staging = staging
        self.config = config
        self.recorder = recorder  # a delivered room's trace record is emitted here
        self.stream_policy = stream_policy  # told the Anchor delivery of rooms sent after forward
        self._entries: list[InFlight] = []

    def __len__(self) -> int:
        return len(self._entries)

    def allocate(self, nbytes: int) -> StagingRange:
        """A staging range, waiting up to the transfer timeout. While it waits, this worker's own
        delivered rooms are reaped: their ranges are what it waits for (the worker reaps only
        between groups, so a plain wait held them until it timed out)."""
        timeout = self.config.transfer_timeout_s
        deadline = time.monotonic() + timeout
        # try_allocate raises at once for a request larger than the whole pool.
        while (staging := self.staging.try_allocate(nbytes)) is None:
            self.reap()
            left = deadline - time.monotonic()
            if left <= 0:
                raise StagingFullError(
                    f"no {nbytes} B of staging free within {timeout:g} s "
                    f"({self.staging.free_bytes()} B free): raise --lynx-staging-mib on the "
                    "prefill, or admit fewer concurrent requests")
            self.staging.wait_for_free(min(left, STAGING_POLL_S))
        return staging

    def add(self, f: InFlight) -> None:
        """`f`'s streams are (being) written: its range lives until they are delivered."""
        self._entries.append(f)

    def undo(self, f: InFlight | None) -> None:
        """A room whose streams failed before they were all written: a stream never written
        stays pending for the transport, so the reaper would never free its range. (None: a
        windowed room, whose writer gives back its own unfinished segment.)"""
        if f is None or f not in self._entries:
            return  # a windowed room's, or already reaped
        self._entries.remove(f)
        release_request(f.session, f.room)
        self.staging.free(f.staging)

    def reap(self) -> None:
        """Free the staging of rooms the transport has delivered (or failed)."""
        streams = (Stream.ANCHOR, Stream.RESIDUAL) if self.config.residual else (Stream.ANCHOR,)
        keep = []
        for f in self._entries:
            try:
                done = all(f.session.send_state(f.room, s).done for s in streams)
            except UnknownRequestError:
                # Nothing written yet: a group opens every room before it writes any (a later
                # room's `allocate` reaps meanwhile). Its writer still owns the range while the
                # session lives; a closed session will never carry it.
                done = f.session.closed
            except TransportError:
                done = True
            if not done:
                keep.append(f)
                continue
            self._measure_link(f)
            # Before the release: the transport forgets the request's stream states with it
            # (read after it, the send marks and the anchor_send / residual_send stages were lost).
            if f.trace is not None:
                _trace_streams(f, streams)
            release_request(f.session, f.room)
            self.staging.free(f.staging)
            if f.trace is not None:
                self.recorder.emit(f.trace)
        self._entries[:] = keep

    def _measure_link(self, f: InFlight) -> None:
        """A room sent after its forward, delivered: its Anchor's time from ready to delivered."""
        if self.stream_policy is None or f.ready_at is None or f.decode is None:
            return
        try:
            st = f.session.send_state(f.room, Stream.ANCHOR)
        except TransportError:
            return
        if st.ok and st.t_done is not None and st.nbytes:
            self.stream_policy.observe_anchor(f.decode, st.nbytes, st.t_done - f.ready_at)


def _trace_streams(f: InFlight, streams: tuple[Stream, ...]) -> None:
    for stream in streams:
        name = "anchor" if stream is Stream.ANCHOR else "residual"
        try:
            st = f.session.send_state(f.room, stream)
        except TransportError:
            continue
        f.trace.mark_mono(f"{name}_first_sent", st.t_first_byte)
        if st.ok:
            f.trace.mark_mono(f"{name}_acked", st.t_done)
        elif st.reason is not None:
            f.trace.facts[f"{name}_failure"] = f"{st.reason.value} {st.detail}"


def release_request(session: Session, request_id: int) -> None:
    """Withdraw one request's streams from the transport (no byte of its range is read after)."""
    try:
        session.release(request_id)
    except TransportError as exc:
        logger.debug("lynx: release of room %s: %s", request_id, exc)
