"""Session authentication and admission limits without sockets (`lynx_transport.auth`, `.limits`):
key derivation, MACs with replay protection, the no-secret rules, the HELLO rate limiter."""

from __future__ import annotations

import os

import pytest

from lynx_transport import Endpoint, Limits
from lynx_transport.auth import (
    NONCE_BYTES,
    Channel,
    SessionKeys,
    check_exposure,
    check_secret,
    data_proof,
)
from lynx_transport.limits import RateLimiter
from lynx_transport.wire import encode

SECRET = b"a shared secret of 32 bytes....."
SID = os.urandom(16)
N_I, N_A = os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)


def test_keys_depend_on_secret_session_and_both_nonces():
    k = SessionKeys.derive(SECRET, SID, N_I, N_A)
    assert k == SessionKeys.derive(SECRET, SID, N_I, N_A)
    assert len({k.initiator, k.acceptor, k.data}) == 3
    others = [SessionKeys.derive(b"another secret, 32 bytes long..", SID, N_I, N_A),
              SessionKeys.derive(SECRET, os.urandom(16), N_I, N_A),
              SessionKeys.derive(SECRET, SID, os.urandom(NONCE_BYTES), N_A),
              SessionKeys.derive(SECRET, SID, N_I, os.urandom(NONCE_BYTES))]
    assert all(o.initiator != k.initiator and o.data != k.data for o in others)
    with pytest.raises(ValueError):
        SessionKeys.derive(SECRET, SID, N_I[:-1], N_A)
    assert data_proof(k.data, SID, 0) != data_proof(k.data, SID, 1)


def test_channel_refuses_forged_altered_replayed_and_reflected_messages():
    keys = SessionKeys.derive(SECRET, SID, N_I, N_A)
    initiator, acceptor = Channel(keys, initiator=True), Channel(keys, initiator=False)
    frames = encode("ABORT", SID, {"req": 1, "stream": None, "reason": "aborted"})
    auth = initiator.seal(frames)
    assert acceptor.check(tuple(frames), auth) is None
    assert acceptor.check(tuple(frames), auth) == "replayed"
    later = encode("HB", SID, {})
    auth2 = initiator.seal(later)
    auth3 = initiator.seal(later)
    assert acceptor.check(tuple(later), auth3) is None
    assert acceptor.check(tuple(later), auth2) == "replayed"  # reordered: older than the floor
    altered = [frames[0], frames[1].replace(b'"req":1', b'"req":2'), frames[2]]
    assert acceptor.check(tuple(altered), initiator.seal(frames)) == "bad_mac"
    # moving bytes between frames changes the MAC (frames are length-prefixed)
    shifted = [frames[0], frames[1][:-1], frames[1][-1:] + frames[2]]
    assert acceptor.check(tuple(shifted), initiator.seal(frames)) == "bad_mac"
    # a message the acceptor sent cannot be reflected back to it as the initiator's
    own = acceptor.seal(frames)
    assert acceptor.check(tuple(frames), own) == "bad_mac"
    assert initiator.check(tuple(frames), own) is None
    wrong = Channel(SessionKeys.derive(b"x" * 32, SID, N_I, N_A), initiator=True)
    assert acceptor.check(tuple(frames), wrong.seal(frames)) == "bad_mac"
    assert acceptor.check(tuple(frames), None) == "bad_mac"
    assert acceptor.check(tuple(frames), b"\0" * 40) == "bad_mac"


def test_secret_rules():
    assert check_secret(None) is None
    assert check_secret(bytearray(SECRET)) == SECRET
    with pytest.raises(TypeError, match="bytes"):
        check_secret("a string secret of enough length")
    with pytest.raises(ValueError, match="at least 16"):
        check_secret(b"short")
    for host in ("127.0.0.1", "127.0.0.5", "::1", "localhost"):
        check_exposure(host, None, False)
    for host in ("0.0.0.0", "10.1.2.3", "::", "eth0", "example.org"):
        with pytest.raises(ValueError, match="secret="):
            check_exposure(host, None, False)
        check_exposure(host, SECRET, False)
        check_exposure(host, None, True)


def test_endpoint_refuses_to_listen_beyond_loopback_without_a_secret():
    with pytest.raises(ValueError, match="allow_insecure=True"):
        Endpoint(host="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16"):
        Endpoint(secret=b"1234")
    with Endpoint(host="0.0.0.0", allow_insecure=True) as ep:
        assert ep.address.startswith("tcp://0.0.0.0:")
    with Endpoint(host="0.0.0.0", secret=SECRET) as ep:
        assert ep.address.startswith("tcp://0.0.0.0:")


def test_rate_limiter_buckets_per_address():
    rl = RateLimiter(rate=10.0, burst=3, max_keys=4)
    assert [rl.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert rl.allow("b", 0.0)  # another address has its own bucket
    assert not rl.allow("a", 0.05) and rl.allow("a", 0.1)  # refills at `rate`
    for i in range(100):  # the table stays bounded; the oldest idle addresses go first
        rl.allow(f"x{i}", 1.0)
    assert len(rl._buckets) <= 4


def test_limits_are_validated():
    Limits()
    for bad in ({"max_sessions": 0}, {"hello_rate": 0}, {"handshake_timeout_s": -1},
                {"max_message_bytes": 1024}):
        with pytest.raises(ValueError):
            Limits(**bad)


def test_both_ends_of_a_session_share_its_channel_binding_and_no_other_session_does():
    """What a rank claim is signed over (`Session.channel_binding`): equal at the two ends of one
    session (the acceptor's used to have no keys on its Session), different for the next session
    between the same endpoints."""
    rx, tx = Endpoint(name="rx", secret=SECRET), Endpoint(name="tx", secret=SECRET)
    try:
        seen = []
        for _ in range(2):
            s_tx = tx.connect(rx.address, timeout=5)
            s_rx = rx.accept(timeout=5)
            assert s_rx is not None
            assert s_tx.channel_binding == s_rx.channel_binding
            assert len(s_tx.channel_binding) == 32
            seen.append(s_tx.channel_binding)
            s_tx.close()
        assert seen[0] != seen[1]
    finally:
        tx.close()
        rx.close()
