"""Bootstrap registrations on their own (no SGLang needed; issue 56, hole 4): SGLang's bootstrap
server kept the last row anyone sent for a slot, so a `PUT /route` re-registering a live rank's
ip:port with another key failed its rooms (no secret needed), and a secret holder could put its own
key there. `backend.registration.RegistrationBook` admits only rows authenticated with the
secret and signed with the key they register, never another key for a live slot; an honest
restart (a new key) is accepted once the old holder's lease lapses. The same over HTTP, through
the real `LynxKVBootstrapServer`: tests/sglang/test_conn_rank_binding.py."""

from __future__ import annotations

import copy
import time

import pytest

from lynx_sglang.backend import registration
from lynx_sglang.backend.rank_key import BOOTSTRAP_FIELD, RankKey
from lynx_sglang.backend.registration import (
    FIELD,
    LEASE_S,
    Registrar,
    RegistrationBook,
    RegistrationRefused,
)

SECRET = b"the deployment's secret, 32 B..."
RANK = ("10.0.0.1", 5000)


def _row(ip: str = RANK[0], port: int = RANK[1], tp: int = 0) -> dict:
    """A prefill's bootstrap row as SGLang 0.5.23 sends it (the fields the book reads, and some)."""
    return {"attn_tp_size": 1, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": ip, "rank_port": port,
            "page_size": 1, "kv_cache_dtype": "auto"}


def _admit(book: RegistrationBook, row: dict, now: float) -> None:
    slot, holder = book.check(row, now)
    book.record(slot, holder)


@pytest.fixture
def live():
    """A book holding the real rank's registration at t = 100 (this server's monotonic time)."""
    book = RegistrationBook(SECRET)
    real = Registrar(SECRET, RankKey())
    row = real.sign(_row())
    _admit(book, row, 100.0)
    return book, real, row


def test_the_real_registration_is_admitted_and_listed(live):
    book, _real, row = live
    assert book.key_of(RANK) == row[BOOTSTRAP_FIELD]


def test_an_unauthenticated_reregistration_with_another_key_changes_nothing(live):
    """The issue's attack: the real row, its key replaced, sent without the secret (or with a
    wrong one, or with no Lynx proof at all)."""
    book, _real, row = live
    forged = {**row, BOOTSTRAP_FIELD: RankKey().public}  # the real proof, another key
    no_secret = Registrar(None, RankKey()).sign(_row())
    wrong_secret = Registrar(b"another secret of 32 bytes......", RankKey()).sign(_row())
    bare = {k: v for k, v in _row().items()} | {BOOTSTRAP_FIELD: RankKey().public}
    for attempt, why in ((forged, "not authenticated"), (no_secret, "not authenticated"),
                         (wrong_secret, "not authenticated"), (bare, "not signed by a Lynx")):
        with pytest.raises(RegistrationRefused, match=why) as refused:
            book.check(attempt, 100.5)
        assert refused.value.status == 403
    assert book.key_of(RANK) == row[BOOTSTRAP_FIELD]


def test_a_secret_holder_cannot_put_its_key_on_a_live_slot(live):
    """With the secret, the attacker's row is authentic and signed with its own key: refused
    while the real rank's lease runs, at its ip:port or its own."""
    book, _real, row = live
    for ip, port in (RANK, ("10.6.6.6", 5000)):
        thief = Registrar(SECRET, RankKey()).sign(_row(ip, port))
        with pytest.raises(RegistrationRefused, match="held by live prefill rank") as refused:
            book.check(thief, 100.0 + LEASE_S - 0.1)
        assert refused.value.status == 409
    assert book.key_of(RANK) == row[BOOTSTRAP_FIELD]


def test_a_row_signed_with_another_key_than_it_registers_is_refused(live):
    book, _, _ = live
    row = Registrar(SECRET, RankKey()).sign(_row(tp=1))
    row[BOOTSTRAP_FIELD] = RankKey().public  # a key whose private half the sender lacks
    # the MAC covers the key too: with the secret, recompute it to reach the signature check
    at = row[FIELD]["time"]
    row[FIELD]["mac"] = registration._mac(
        SECRET, registration._canonical(registration._REGISTRATION_LABEL, row, at))
    with pytest.raises(RegistrationRefused, match="not signed with the rank key it registers"):
        book.check(row, 100.0)


def test_an_honest_restart_is_accepted_once_the_old_lease_lapses(live):
    book, _real, row = live
    restarted = Registrar(SECRET, RankKey()).sign(_row())
    with pytest.raises(RegistrationRefused, match="held by live"):
        book.check(restarted, 100.0 + LEASE_S / 2)
    _admit(book, restarted, 100.0 + LEASE_S + 0.01)
    assert book.key_of(RANK) == restarted[BOOTSTRAP_FIELD]
    # the dead process's registration, replayed now, does not bring its key back
    with pytest.raises(RegistrationRefused, match="not newer") as refused:
        book.check(row, 100.0 + 10 * LEASE_S)
    assert refused.value.status == 409
    assert book.key_of(RANK) == restarted[BOOTSTRAP_FIELD]


def test_renewals_keep_a_slot_live_and_only_its_holder_renews(live):
    book, real, row = live
    t = 100.0
    for _ in range(5):  # past several leases
        t += LEASE_S * 0.6
        time.sleep(0.002)  # the renewal's time must grow
        book.renew(real.lease(row), t)
    with pytest.raises(RegistrationRefused, match="held by live"):
        book.check(Registrar(SECRET, RankKey()).sign(_row()), t + LEASE_S * 0.9)
    body = real.lease(row)
    book.renew(copy.deepcopy(body), t + 1)
    with pytest.raises(RegistrationRefused, match="not newer"):
        book.renew(body, t + 1.5)  # replayed
    other = Registrar(SECRET, RankKey())
    with pytest.raises(RegistrationRefused, match="no such registration"):
        book.renew(other.lease(row), t + 2)
    stolen = real.lease(row)
    stolen[FIELD]["sig"] = RankKey().sign_bytes(b"x")
    with pytest.raises(RegistrationRefused, match="not signed with the slot's rank key"):
        book.renew(stolen, t + 2)


def test_replays_of_the_holders_own_row_do_not_keep_a_dead_slot(live):
    """Replaying the holder's last row (an attacker who recorded it) must not renew its lease,
    or a restarted rank would be kept out for as long as the replays go on."""
    book, _real, row = live
    for t in (102.0, 104.0, 106.0):
        _admit(book, row, t)  # SGLang's retry of a landed PUT, or a replay: admitted, no renewal
    _admit(book, Registrar(SECRET, RankKey()).sign(_row()), 100.0 + LEASE_S + 0.01)


def test_a_proof_from_another_time_is_refused(live, monkeypatch):
    book, _, _ = live
    row = Registrar(SECRET, RankKey()).sign(_row(tp=1))
    monkeypatch.setattr(time, "time", lambda: row[FIELD]["time"] + registration.MAX_SKEW_S + 1)
    with pytest.raises(RegistrationRefused, match="from this server's clock"):
        book.check(row, 100.0)


@pytest.mark.parametrize("junk", [[], "x", {"rank_ip": 1}, {**_row(), "attn_tp_rank": -1},
                                  {**_row(), "pp_rank": True}, {**_row(), FIELD: "x"}])
def test_malformed_rows_are_refused(junk):
    with pytest.raises(RegistrationRefused):
        RegistrationBook(SECRET).check(junk, 0.0)


def test_without_a_secret_signatures_and_leases_still_hold():
    book = RegistrationBook(None)
    real = Registrar(None, RankKey())
    _admit(book, real.sign(_row()), 100.0)
    with pytest.raises(RegistrationRefused, match="held by live"):
        book.check(Registrar(None, RankKey()).sign(_row()), 101.0)
