"""The failure kinds of `lynx_request_failures_total` come from a failure's type, not its words."""

from __future__ import annotations

import pytest

from lynx_kernels import CodecError
from lynx_sglang.errors import (
    KVStreamError,
    RoomDroppedError,
    SettingsMismatchError,
    StagingFullError,
)
from lynx_sglang.failures import FailureKind, failure_kind_of, stream_failure_kind
from lynx_transport import FailureReason, Refused
from lynx_transport.types import (
    AnnouncementTimeoutError,
    HandshakeError,
    SessionClosedError,
    UnknownRequestError,
)


@pytest.mark.parametrize(("exc", "kind"), [
    # the words of each message point elsewhere: only the type may decide
    (StagingFullError("no 4096 B of staging free within 0 s"), FailureKind.STAGING_FULL),
    (SettingsMismatchError("decode refused: stream closed"), FailureKind.SETTINGS_MISMATCH),
    (AnnouncementTimeoutError("no announcement for request 7 within 30 s"), FailureKind.TIMEOUT),
    (UnknownRequestError("request 7: no (live) announcement from the peer"), FailureKind.ABORTED),
    (SessionClosedError("timeout waiting for heartbeats"), FailureKind.PEER_DIED),
    (HandshakeError("peer closed"), FailureKind.SETTINGS_MISMATCH),
    (KVStreamError("settings"), FailureKind.BAD_DATA),
    (RoomDroppedError("SGLang dropped the room: bad data"), FailureKind.ABORTED),
    (CodecError("timeout"), FailureKind.BAD_DATA),
    (Refused(FailureReason.OUT_OF_BOUNDS, "staging"), FailureKind.BAD_DATA),
    (TimeoutError(), FailureKind.TIMEOUT),
    (RuntimeError("staging settings timeout"), FailureKind.OTHER),
])
def test_exceptions_map_by_type(exc, kind):
    assert failure_kind_of(exc) is kind


def test_every_stream_failure_reason_has_a_kind():
    kinds = {reason: stream_failure_kind(reason) for reason in FailureReason}
    assert kinds[FailureReason.PEER_DIED] is FailureKind.PEER_DIED
    assert kinds[FailureReason.TIMEOUT] is FailureKind.TIMEOUT
    assert kinds[FailureReason.CORRUPTION] is FailureKind.BAD_DATA
    assert kinds[FailureReason.RELEASED] is FailureKind.ABORTED
