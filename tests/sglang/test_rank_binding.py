"""The rank binding on its own (no SGLang needed): a prefill rank's claim is signed for one decode
with its rank key (`backend.rank_key`), and the decode counts it only with the key the bootstrap
server lists for the rank (`backend.decode.bindings.RankBindings`): asked again once per claim
when it differs (a prefill restarted at the same ip:port), never more often than `FRESH_S`, never
blocking the caller, and every failure of that lookup ends in a refusal that says why."""

from __future__ import annotations

import threading
import time

import pytest

from lynx_sglang.backend.decode import bindings as decode_bindings
from lynx_sglang.backend.decode.bindings import (
    BOUND,
    PENDING,
    BootstrapSlot,
    RankBindings,
    Registration,
)
from lynx_sglang.backend.identity import Identity
from lynx_sglang.backend.rank_key import Claimant, RankKey, proven, valid_key

RANK = ("10.0.0.1", 5000)
SLOT = BootstrapSlot("10.0.0.1:8998", 0, 0, 0, 0)
DECODE = "tcp://10.0.0.2:7000"


BINDING = b"\x07" * 32  # a session's channel binding


def test_a_claim_is_proven_only_for_its_rank_key_decode_and_session():
    key = RankKey()
    claim = Claimant(Identity(*RANK), key).claim(DECODE, BINDING)
    assert claim.key == key.public and valid_key(key.public) == key.public
    assert proven(claim, DECODE, BINDING)
    assert not proven(claim, "tcp://10.0.0.3:7000", BINDING)  # passed on to another decode
    assert not proven(claim, DECODE, b"\x08" * 32)  # replayed on another session
    assert not proven(Identity("10.0.0.9", 5000, key=claim.key, proof=claim.proof), DECODE,
                      BINDING)
    assert not proven(Identity(*RANK, key=RankKey().public, proof=claim.proof), DECODE, BINDING)
    for key_hex, proof_hex in (("", ""), ("zz" * 32, claim.proof), (claim.key, "00" * 64),
                               (claim.key.upper(), claim.proof), (claim.key[:-2], claim.proof)):
        assert not proven(Identity(*RANK, key=key_hex, proof=proof_hex), DECODE, BINDING)
    assert valid_key(key.public.upper()) is None and valid_key(" " + key.public[1:]) is None


class _Bootstrap:
    """A bootstrap server's lookup: answers `listed`, counting the lookups; `gate`, if set, holds
    each answer until it is set."""

    def __init__(self, listed: Registration | Exception, gate: threading.Event | None = None):
        self.listed, self.gate, self.asked = listed, gate, 0

    def __call__(self, slot, timeout):
        assert slot == SLOT and timeout == decode_bindings.LOOKUP_TIMEOUT_S
        self.asked += 1
        if self.gate is not None:
            self.gate.wait(5)
        if isinstance(self.listed, Exception):
            raise self.listed
        return self.listed


def _settle(bindings: RankBindings, key: str, arrived: float):
    """The verdict once no re-lookup is running (bounded wait)."""
    deadline = time.monotonic() + 5
    while (verdict := bindings.check(RANK, key, arrived)) is PENDING:
        assert time.monotonic() < deadline, "a re-lookup never finished"
        time.sleep(0.01)
    return verdict


@pytest.fixture
def stale(monkeypatch):
    """Every recorded answer counts as older than FRESH_S."""
    monkeypatch.setattr(decode_bindings, "FRESH_S", 0.0)


def test_an_unlooked_up_rank_and_a_mismatching_key_are_refused_without_a_lookup():
    bootstrap = _Bootstrap(Registration(RANK, "ab" * 32))
    bindings = RankBindings(bootstrap)
    assert "no bootstrap lookup of this decode named" in bindings.check(RANK, "ab" * 32,
                                                                          time.monotonic()).refused
    bindings.record(SLOT, Registration(RANK, "ab" * 32))
    assert bindings.check(RANK, "ab" * 32, time.monotonic()) is BOUND
    # The answer is younger than FRESH_S: a claim with another key is refused at once.
    why = bindings.check(RANK, "cd" * 32, time.monotonic()).refused
    assert "registered rank key abababab" in why and SLOT.bootstrap_addr in why
    bindings.record(SLOT, Registration(RANK, None))
    assert "registered no rank key" in bindings.check(RANK, "ab" * 32, time.monotonic()).refused
    assert bootstrap.asked == 0
    bindings.close()


def test_a_restarted_prefill_is_accepted_after_one_lookup_and_an_impostor_refused(stale):
    """The recorded key is a previous process's: the new one's claim is looked up again and
    bound; a claim with a third key then gets its one lookup and is refused."""
    new = RankKey().public
    bootstrap = _Bootstrap(Registration(RANK, new))
    bindings = RankBindings(bootstrap)
    bindings.record(SLOT, Registration(RANK, RankKey().public))
    arrived = time.monotonic()
    assert bindings.check(RANK, new, arrived) is PENDING
    assert _settle(bindings, new, arrived) is BOUND and bootstrap.asked == 1
    impostor = RankKey().public
    arrived = time.monotonic()
    why = _settle(bindings, impostor, arrived).refused
    assert f"registered rank key {new[:16]}" in why and bootstrap.asked == 2
    assert bindings.check(RANK, impostor, arrived).refused == why  # not asked again
    assert bootstrap.asked == 2
    bindings.close()


@pytest.mark.parametrize("listed, said", [
    (LookupError("HTTP 503: not ready"), "looking it up again failed: HTTP 503"),
    (Registration(("10.0.0.1", 5001), "ab" * 32), "now lists 10.0.0.1:5001 there"),
])
def test_a_failed_or_moved_lookup_refuses_the_claim_saying_why(stale, listed, said):
    bootstrap = _Bootstrap(listed)
    bindings = RankBindings(bootstrap)
    bindings.record(SLOT, Registration(RANK, "ab" * 32))
    assert said in _settle(bindings, "cd" * 32, time.monotonic()).refused
    bindings.close()


def test_check_never_waits_for_a_lookup_and_claims_share_one(stale):
    gate = threading.Event()
    bootstrap = _Bootstrap(Registration(RANK, "ab" * 32), gate)
    bindings = RankBindings(bootstrap)
    bindings.record(SLOT, Registration(RANK, "00" * 32))
    t0 = time.monotonic()
    for key in ("ab" * 32, "cd" * 32, "ab" * 32):
        assert bindings.check(RANK, key, t0) is PENDING
    assert time.monotonic() - t0 < 0.5
    gate.set()
    assert _settle(bindings, "ab" * 32, t0) is BOUND
    assert "registered rank key" in _settle(bindings, "cd" * 32, t0).refused
    assert bootstrap.asked == 1
    bindings.close()


def test_the_table_is_bounded(monkeypatch):
    monkeypatch.setattr(decode_bindings, "MAX_RANKS", 3)
    bindings = RankBindings(_Bootstrap(LookupError("unused")))
    for port in range(5000, 5005):
        bindings.record(SLOT, Registration(("10.0.0.1", port), "ab" * 32))
    assert bindings.check(RANK, "ab" * 32, time.monotonic()).refused  # the oldest went first
    assert bindings.check(("10.0.0.1", 5004), "ab" * 32, time.monotonic()) is BOUND
    bindings.close()
