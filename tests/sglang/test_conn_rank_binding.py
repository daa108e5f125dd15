"""Issue 42, item 7: a peer that holds the deployment's transport secret claims a real prefill
rank before the real prefill connects. Lynx's prefill and decode KV managers with SGLang's own
machinery and bootstrap server in one process (conn_pair.py), the secret set: the impostor's claim
is refused (it is not signed with the rank key the rank registered with SGLang's bootstrap
server), it never sees a room, and the real prefill's requests go through; a real prefill whose
recorded key is stale (restarted at the same ip:port) is looked up again and accepted.

Issue 56, hole 4, over HTTP against the real `LynxKVBootstrapServer`: a `PUT /route` that
re-registers the real rank with another key, without the secret, changes nothing; a secret
holder's own registration for the live rank's slot is refused; an honest restart (a new key,
once the old lease has lapsed) is accepted; a lease renewal is taken from the holder only.
"""

from __future__ import annotations

import json
import os

import pytest
import requests
from conn_pair import (
    LOOPBACK,
    NUM_TOKENS,
    failure_message,
    forward_and_send,
    holds,
    make_cfg,
    poll_until_done,
    request_metadata,
    start_request,
    wait_for,
)

from lynx_sglang.backend import registration
from lynx_sglang.backend.decode import bindings as decode_bindings
from lynx_sglang.backend.decode.bindings import BootstrapSlot, Registration
from lynx_sglang.backend.identity import IDENTITY_REQUEST
from lynx_sglang.backend.rank_key import BOOTSTRAP_FIELD, RankKey
from lynx_sglang.backend.registration import LEASE_PATH, Registrar
from lynx_sglang.names import SECRET_ENV
from lynx_transport import Endpoint

pytestmark = pytest.mark.sglang

SECRET = os.urandom(32)


@pytest.fixture
def secret_pd(make_pd, monkeypatch):
    """A prefill and a decode that authenticate their sessions with SECRET (`make_pd(cfg)`)."""
    monkeypatch.setenv(SECRET_ENV, SECRET.hex())
    return make_pd


def _claim(thief: Endpoint, pd, settings: dict | None = None, key: RankKey | None = None):
    """The impostor: a session to the decode (it holds the secret) announcing the real prefill's
    rank with the decode's own wire settings (or `settings`), signed with `key` if given; returns
    the session and the decode's answer."""
    decode, prefill = pd.decode.mgr, pd.prefill.mgr
    rank = (prefill.local_ip, prefill.rank_port)
    session = thief.connect(decode.endpoint.address, timeout=5)
    who = {"rank_ip": rank[0], "rank_port": rank[1],
           "config": settings if settings is not None else decode.lynx.wire_settings()}
    if key is not None:
        who.update(key=key.public, proof=key.sign(rank, decode.endpoint.address,
                                                  session.channel_binding))
    session.announce(IDENTITY_REQUEST, {}, meta=json.dumps(who).encode())
    return session, json.loads(bytes(session.wait_announcement(IDENTITY_REQUEST, timeout=5).meta))


def _expect_delivered(sgl, pd, req) -> None:
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert holds(pd, req, "full")


def test_an_impostor_that_claims_a_rank_first_gets_none_of_its_rooms(sgl, secret_pd):
    """Before the fix the decode took the first claim: the impostor was accepted as the rank, the
    room was announced to it, and the real prefill was refused ("claims prefill rank ..., which a
    live session already serves")."""
    pd = secret_pd(make_cfg(target="exact"))
    rank = (pd.prefill.mgr.local_ip, pd.prefill.mgr.rank_port)
    refused = f"claim to prefill rank {rank[0]}:{rank[1]} was refused"
    with Endpoint(host=LOOPBACK, secret=SECRET) as thief:
        signed, said = _claim(thief, pd, key=RankKey())  # a valid key, not the rank's
        assert refused in said.get("refused", ""), said
        unsigned, said = _claim(thief, pd)
        assert refused in said.get("refused", ""), said
        assert pd.decode.mgr.applier.sessions.refused(rank) is None
        req = start_request(sgl, pd, room=4207, seed=7)
        _expect_delivered(sgl, pd, req)
        assert signed.announcement(req.room) is None and unsigned.announcement(req.room) is None
        assert pd.decode.mgr.applier.sessions.get(rank) is not None
        assert pd.decode.mgr.applier.sessions.get(rank) not in (signed, unsigned)


def test_an_impostor_after_the_lookup_cannot_get_the_real_rank_refused(sgl, secret_pd):
    """The impostor claims once the decode has looked the rank up and announced a room to come,
    with other wire settings: unbound, that claim would have marked the rank refused and failed
    the room. It is refused instead, and the room is delivered by the real prefill."""
    pd = secret_pd(make_cfg(target="exact"))
    req, g = request_metadata(sgl, pd, room=4208, seed=8)
    with Endpoint(host=LOOPBACK, secret=SECRET) as thief:
        other = {**pd.decode.mgr.lynx.wire_settings(), "target": "int8"}
        session, said = _claim(thief, pd, settings=other, key=RankKey())
        assert "registered rank key" in said.get("refused", ""), said
        wait_for("the prefill to get the decode's KV indices",
                 lambda: req.sender.poll() == sgl.KVPoll.WaitingForInput)
        req.sender.init(NUM_TOKENS, req.prefill_aux)
        forward_and_send(pd, req, g)
        _expect_delivered(sgl, pd, req)
        assert session.announcement(req.room) is None


def test_a_prefill_whose_recorded_key_is_stale_is_looked_up_again(sgl, secret_pd, monkeypatch):
    """The decode recorded another key for the rank (a previous process at the same ip:port):
    the real prefill's claim makes it ask SGLang's bootstrap server again, which lists the real
    key, and the request goes through."""
    monkeypatch.setattr(decode_bindings, "FRESH_S", 0.0)
    pd = secret_pd(make_cfg(target="exact"))
    req, g = request_metadata(sgl, pd, room=4209, seed=9)
    rank = (pd.prefill.mgr.local_ip, pd.prefill.mgr.rank_port)
    pd.decode.mgr.applier.bindings.record(BootstrapSlot(pd.bootstrap_addr, 0, 0, 0, 0),
                                          Registration(rank, RankKey().public))
    wait_for("the prefill to get the decode's KV indices",
             lambda: req.sender.poll() == sgl.KVPoll.WaitingForInput)
    req.sender.init(NUM_TOKENS, req.prefill_aux)
    forward_and_send(pd, req, g)
    _expect_delivered(sgl, pd, req)


def _put(pd, row: dict, path: str = "/route") -> requests.Response:
    return requests.put(f"http://{pd.bootstrap_addr}{path}", json=row, timeout=5)


def _listed_key(pd) -> str | None:
    # imported here: importing SGLang before the `sgl` fixture's CPU set-up fails collection
    from lynx_sglang.backend.conn import lookup_prefill_rank

    return lookup_prefill_rank(BootstrapSlot(pd.bootstrap_addr, 0, 0, 0, 0), 5).key


def test_bootstrap_registrations_need_the_secret_and_a_live_slot_keeps_its_key(
        sgl, secret_pd, monkeypatch):
    """Before the fix the first PUT below made the real rank's rooms fail within 0.2 s (the decode
    saw another key listed for it), and the second put the thief's key on the rank."""
    pd = secret_pd(make_cfg(target="exact"))
    (_, real_row), = pd.prefill.mgr.role.registered
    real_key = real_row[BOOTSTRAP_FIELD]
    assert _listed_key(pd) == real_key
    # no secret: the real row with another key (the real proof kept), and a fresh unsigned row
    forged = {**real_row, BOOTSTRAP_FIELD: RankKey().public}
    unsigned = {k: v for k, v in real_row.items() if k != registration.FIELD}
    for row in (forged, unsigned):
        r = _put(pd, row)
        assert r.status_code == 403, r.text
    # with the secret: the thief's own key for the live slot, at the rank's ip:port or its own
    thief = Registrar(SECRET, RankKey())
    for ip_port in ({}, {"rank_ip": "127.0.0.66", "rank_port": 4066}):
        r = _put(pd, thief.sign({**unsigned, **ip_port}))
        assert r.status_code == 409 and "held by live prefill rank" in r.text, r.text
    assert _listed_key(pd) == real_key
    req = start_request(sgl, pd, room=4210, seed=10)
    _expect_delivered(sgl, pd, req)
    # the holder renews its lease; nobody else can
    assert _put(pd, pd.prefill.mgr.registrar.lease(real_row), LEASE_PATH).status_code == 200
    assert _put(pd, thief.lease(real_row), LEASE_PATH).status_code == 409
    # an honest restart: a new process, a new key, once the old lease has lapsed (here: at once)
    monkeypatch.setattr(registration, "LEASE_S", 0.0)
    restarted = Registrar(SECRET, RankKey())
    r = _put(pd, restarted.sign(unsigned))
    assert r.status_code == 200, r.text
    assert _listed_key(pd) == restarted.lease(real_row)["key"]
