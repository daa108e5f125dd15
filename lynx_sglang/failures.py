"""Why a request's transfer failed, as a bounded label: `FailureKind` (the `kind` of
`lynx_request_failures_total`, `lynx_sglang.metrics`). The backend (`backend.prefill.worker`,
`backend.decode.applier`, `backend.manager`) decides it where it finds the failure, from the exception's
type (`failure_kind_of`) or the transport's reason for a failed stream (`stream_failure_kind`),
never from a message's words.
"""

from __future__ import annotations

import enum

from lynx_kernels import CodecError
from lynx_transport.backend import Refused
from lynx_transport.types import (
    AnnouncementTimeoutError,
    FailureReason,
    HandshakeError,
    OutOfBoundsError,
    SessionClosedError,
    UnknownRequestError,
)

from .errors import KVStreamError, RoomDroppedError, SettingsMismatchError, StagingFullError


class FailureKind(enum.Enum):
    """Why a request's transfer failed, as a bounded label (`lynx_request_failures_total{kind}`):
    decided where the failure is found, from its exception's type or the transport's reason,
    never from its free-text message."""

    SETTINGS_MISMATCH = "settings_mismatch"
    TIMEOUT = "timeout"
    PEER_DIED = "peer_died"
    BAD_DATA = "bad_data"
    STAGING_FULL = "staging_full"
    ABORTED = "aborted"
    OTHER = "other"


_STREAM_KINDS = {
    FailureReason.PEER_DIED: FailureKind.PEER_DIED,
    FailureReason.TIMEOUT: FailureKind.TIMEOUT,
    FailureReason.CORRUPTION: FailureKind.BAD_DATA,
    FailureReason.OUT_OF_BOUNDS: FailureKind.BAD_DATA,
    FailureReason.UNKNOWN_REQUEST: FailureKind.BAD_DATA,
    FailureReason.RELEASED: FailureKind.ABORTED,
    FailureReason.ABORTED: FailureKind.ABORTED,
    FailureReason.CLOSED: FailureKind.ABORTED,
    FailureReason.LOCAL_ERROR: FailureKind.OTHER,
}

# Most specific first: the first matching type decides.
_EXCEPTION_KINDS: tuple[tuple[type[BaseException], FailureKind], ...] = (
    (SettingsMismatchError, FailureKind.SETTINGS_MISMATCH),
    (StagingFullError, FailureKind.STAGING_FULL),
    (AnnouncementTimeoutError, FailureKind.TIMEOUT),
    (TimeoutError, FailureKind.TIMEOUT),
    (UnknownRequestError, FailureKind.ABORTED),  # the decode withdrew the request
    (RoomDroppedError, FailureKind.ABORTED),
    (HandshakeError, FailureKind.SETTINGS_MISMATCH),  # secrets, protocol or backend differ
    (SessionClosedError, FailureKind.PEER_DIED),
    (OutOfBoundsError, FailureKind.BAD_DATA),
    (KVStreamError, FailureKind.BAD_DATA),
    (CodecError, FailureKind.BAD_DATA),
)


def failure_kind_of(exc: BaseException) -> FailureKind:
    """The kind of a failure raised as `exc`."""
    if isinstance(exc, Refused):
        return stream_failure_kind(exc.reason)
    for cls, kind in _EXCEPTION_KINDS:
        if isinstance(exc, cls):
            return kind
    return FailureKind.OTHER


def stream_failure_kind(reason: FailureReason) -> FailureKind:
    """The kind of a stream the transport reports failed for `reason`."""
    return _STREAM_KINDS[reason]
