"""What a broken or hostile peer can send the decode applier and the prefill sender, refused without
harm (no SGLang needed): aux items that would overflow SGLang's buffers, malformed or competing
prefill identities (an impostor that claims a rank before the real one, with or without a rank key
of its own), silent sessions that would hold up others, and a dead decode that would stall the
transfers to every other one."""

from __future__ import annotations

import json
import threading
import time
from contextlib import closing
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from loop_thread import LoopThread

from lynx_sglang.backend.aux import check_aux_items, pack_aux, unpack_aux
from lynx_sglang.backend.decode import bindings as decode_bindings
from lynx_sglang.backend.decode import sessions as decode_sessions
from lynx_sglang.backend.decode.applier import DecodeApplier, DecodeLink
from lynx_sglang.backend.decode.bindings import BootstrapSlot, Registration
from lynx_sglang.backend.identity import IDENTITY_REQUEST, Identity
from lynx_sglang.backend.rank_key import Claimant, RankKey
from lynx_sglang.config import LynxConfig
from lynx_sglang.errors import KVStreamError
from lynx_sglang.metrics import Metrics
from lynx_sglang.recorder import Recorder


def test_aux_items_that_do_not_fit_are_refused():
    lens = [64, 8]
    check_aux_items(unpack_aux(pack_aux([b"x" * 64, b"y" * 8])), lens)
    with pytest.raises(KVStreamError, match="holds 64 B"):
        check_aux_items([(0, b"x" * 984)], lens)
    with pytest.raises(KVStreamError, match="2 aux buffers"):
        check_aux_items([(7, b"x")], lens)


@pytest.mark.parametrize("meta", [b"[]", b"1", b'{"rank_ip": "1.2.3.4", "rank_port": null}',
                                  b'{"rank_ip": 5, "rank_port": 80}', b"\xff\xfe",
                                  b'{"rank_ip": "a", "rank_port": 70000}', b'{"rank_port": 80}',
                                  b'{"rank_ip": "a", "rank_port": true}'])
def test_malformed_identities_are_refused(meta):
    assert Identity.parse(meta) is None


DECODE_ADDRESS = "tcp://5.6.7.8:9"
# The rank key the bootstrap server lists for every prefill rank of these tests (`_applier`).
RANK_KEY = RankKey()


# The channel binding of the stand-in sessions (`_Session`), unless a test gives another.
BINDING = bytes(range(32))


def _who(port: int = 4000, config: LynxConfig | None = None, key: RankKey = RANK_KEY,
         ip: str = "1.2.3.4", settings: bool = True, binding: bytes = BINDING) -> bytes:
    """A prefill rank's identity announcement, with its wire settings (unless not `settings`),
    signed with `key` for this decode and the session with channel binding `binding`."""
    who = Identity(ip, port, (config or LynxConfig()).wire_settings() if settings else None)
    return Claimant(who, key).claim(DECODE_ADDRESS, binding).encode()


class _Session:
    def __init__(self, meta: bytes | None, peer: str = "tcp://1.2.3.4:1",
                 binding: bytes = BINDING):
        self.meta, self.peer_address, self.closed = meta, peer, False
        self.channel_binding = binding

    def announcement(self, request_id):
        assert request_id == IDENTITY_REQUEST
        return None if self.meta is None else SimpleNamespace(meta=self.meta)

    def announce(self, request_id, bounds, meta=b""):
        assert request_id == IDENTITY_REQUEST and not bounds
        self.answer = json.loads(meta)

    def close(self):
        self.closed = True


class _Endpoint:
    address = DECODE_ADDRESS

    def __init__(self, sessions):
        self.sessions = list(sessions)

    def accept(self, timeout=None):
        if self.sessions:
            return self.sessions.pop(0)
        time.sleep(min(timeout or 0.01, 0.01))
        return None

    def on_progress(self, listener):
        pass


def _no_bootstrap(slot, timeout):
    raise LookupError("no bootstrap server in this test")


def _applier(endpoint, lookup=_no_bootstrap) -> DecodeApplier:
    """An applier whose bootstrap lookups listed RANK_KEY for ports 4000-4009 of 1.2.3.4 and
    1.2.3.5; asking again goes to `lookup`."""
    link = DecodeLink(lambda *a: None, lambda *a: None, lambda *a: None, lambda: None, lookup)
    applier = DecodeApplier(LynxConfig(), lambda: None, None, None, endpoint, link,
                            Recorder.for_process())
    for ip in ("1.2.3.4", "1.2.3.5"):
        for port in range(4000, 4010):
            applier.bindings.record(BootstrapSlot("boot:1", 0, 0, port - 4000, 0),
                                    Registration((ip, port), RANK_KEY.public))
    return applier


def test_silent_and_malformed_peers_do_not_hold_up_a_real_prefill(monkeypatch):
    monkeypatch.setattr(decode_sessions, "IDENTITY_TIMEOUT_S", 0.5)
    silent = [_Session(None) for _ in range(3)]
    bad = _Session(b"[]")
    real = _Session(_who())
    applier = _applier(_Endpoint([*silent, bad, real]))
    with LoopThread(applier.accept_loop) as loop:
        loop.until(lambda: applier.sessions.get(("1.2.3.4", 4000)) is not None, 0.4,
                   "a real prefill waited for silent strangers")
        assert bad.closed and applier.sessions.get(("1.2.3.4", 4000)) is real
        loop.until(lambda: all(s.closed for s in silent), 3.0,
                   "silent sessions outlived the identity deadline")
        assert loop.thread.is_alive()  # nothing a peer sent stopped the thread


def test_a_live_rank_is_never_taken_over():
    first = _Session(_who())
    thief = _Session(_who(), "tcp://6.6.6.6:1")
    sessions = _applier(_Endpoint([])).sessions
    assert sessions._identify(first, time.monotonic())
    assert sessions._identify(thief, time.monotonic())
    assert thief.closed and not first.closed
    assert sessions.get(("1.2.3.4", 4000)) is first
    first.closed = True  # once the first is gone, a restarted prefill may take the rank
    again = _Session(_who())
    assert sessions._identify(again, time.monotonic()) and not again.closed


def test_other_wire_settings_are_refused_at_connect_naming_the_flags(caplog):
    """A prefill started with other --lynx-* codec flags is refused once, when its session opens,
    with the differing flags named; a prefill without settings (an older version) likewise."""
    sessions = _applier(_Endpoint([])).sessions
    other = LynxConfig.build(target="int8", chunk_tokens=128)
    s = _Session(_who(config=other))
    with caplog.at_level("ERROR"):
        assert sessions._identify(s, time.monotonic())
    assert "--lynx-target" in s.answer["refused"]  # told before its session is closed
    assert sessions.get(("1.2.3.4", 4000)) is None
    why = sessions.refused(("1.2.3.4", 4000))
    assert "--lynx-target: prefill 'int8', decode 'exact'" in why
    assert "--lynx-chunk-tokens: prefill 128, decode 256" in why
    assert "--lynx-anchor-bits" not in why
    assert sum("other --lynx-* settings" in r.message for r in caplog.records) == 1
    bare = _Session(_who(ip="1.2.3.5", settings=False))
    assert sessions._identify(bare, time.monotonic()) and "refused" in bare.answer
    assert "(not sent)" in sessions.refused(("1.2.3.5", 4000))
    fixed = _Session(_who())  # restarted with the same flags: accepted, the refusal forgotten
    assert sessions._identify(fixed, time.monotonic()) and not fixed.closed
    assert fixed.answer == {"accepted": True}
    assert sessions.refused(("1.2.3.4", 4000)) is None


def test_an_impostor_that_claims_a_rank_first_neither_takes_it_nor_gets_it_refused(caplog):
    """A peer holding the transport secret claims a prefill rank before the real prefill does:
    signed with a rank key of its own (not the one the bootstrap server lists), unsigned, with a
    proof the real prefill made for another decode (the impostor's own, which the prefill was
    made to dial), or signed with its own key and other wire settings (which would mark the rank
    refused). Each is refused, saying why; none takes the rank or fails its rooms, and the real
    prefill is accepted after them."""
    sessions = _applier(_Endpoint([])).sessions
    rank = ("1.2.3.4", 4000)
    real_identity = Identity(*rank, LynxConfig().wire_settings())
    claims = {
        "own key": _who(key=RankKey()),
        "unsigned": real_identity.encode(),
        "made for another decode": Claimant(real_identity, RANK_KEY).claim(
            "tcp://6.6.6.6:1", BINDING).encode(),
        "other settings": _who(key=RankKey(), config=LynxConfig.build(target="int8")),
    }
    for what, meta in claims.items():
        thief = _Session(meta, "tcp://6.6.6.6:1")
        with caplog.at_level("ERROR"):
            assert sessions._identify(thief, time.monotonic()), what
        assert "the claim to prefill rank 1.2.3.4:4000 was refused" in thief.answer["refused"]
        assert sessions.get(rank) is None and sessions.refused(rank) is None, what
    assert sum("claims prefill rank 1.2.3.4:4000, refused" in r.message
               for r in caplog.records) == len(claims)
    real = _Session(_who())
    assert sessions._identify(real, time.monotonic()) and real.answer == {"accepted": True}
    assert sessions.get(rank) is real


def test_a_real_claim_replayed_on_another_session_is_refused_and_announces_nothing(caplog):
    """A secret holder who saw the real prefill's claim (on its session, binding A) replays it on a
    session of its own (binding B) after the real rank's session has ended: the claim, signed for
    A, does not verify on B. It is refused, takes no rank, and so is announced no room. (The v1
    claim covered the rank and the decode address only, and was accepted here.)"""
    sessions = _applier(_Endpoint([])).sessions
    rank = ("1.2.3.4", 4000)
    seen = _who(binding=b"A" * 32)
    real = _Session(seen, binding=b"A" * 32)
    assert sessions._identify(real, time.monotonic()) and real.answer == {"accepted": True}
    real.closed = True  # the real rank's session ends
    replay = _Session(seen, "tcp://6.6.6.6:1", binding=b"B" * 32)
    with caplog.at_level("ERROR"):
        assert sessions._identify(replay, time.monotonic())
    assert "a replayed claim" in replay.answer["refused"]
    assert sessions.get(rank) is not replay
    assert "claims prefill rank 1.2.3.4:4000, refused" in caplog.text


def test_a_claim_being_looked_up_again_holds_up_no_other_peer(monkeypatch):
    """A claim whose key differs from the recorded one is looked up again at the bootstrap
    server (here every time: FRESH_S 0); while that lookup hangs, another rank's real prefill is
    accepted at once, and the claim is refused when the answer comes."""
    monkeypatch.setattr(decode_bindings, "FRESH_S", 0.0)
    answer_now = threading.Event()

    def slow_lookup(slot, timeout):
        answer_now.wait(timeout)
        return Registration(("1.2.3.4", 4000), RANK_KEY.public)

    thief = _Session(_who(key=RankKey()), "tcp://6.6.6.6:1")
    other = _Session(_who(port=4001))
    applier = _applier(_Endpoint([thief, other]), slow_lookup)
    with LoopThread(applier.accept_loop) as loop:
        loop.until(lambda: applier.sessions.get(("1.2.3.4", 4001)) is not None, 1.0,
                   "a rank waited for another claim's lookup")
        assert not hasattr(thief, "answer")  # still being looked up
        answer_now.set()
        loop.until(lambda: hasattr(thief, "answer"), 3.0, "the claim was never answered")
        assert "registered rank key" in thief.answer["refused"]
        assert applier.sessions.get(("1.2.3.4", 4000)) is None and loop.thread.is_alive()


def test_draft_logits_of_an_aborted_sampled_request_are_forgotten():
    from lynx_sglang.speculation.controller import SpecController
    from lynx_sglang.speculation.state import SpecState

    transfers = SimpleNamespace(cancel=lambda room: False)
    ctl = SpecController(transfers, LynxConfig(), Recorder.for_process())
    st = SpecState(room=9, sampled=True)
    req = SimpleNamespace(bootstrap_room=9, lynx_spec=st, kv=SimpleNamespace(req_pool_idx=3))
    ctl.sampled_by_pool_idx[3] = st
    for _ in range(100):  # never more rows than speculative tokens
        ctl.record_draft_logits([3], torch.zeros(1, 8))
    assert len(st.draft_logits) == ctl.max_sampled_tokens + 1
    ctl.on_release(req)  # SGLang aborted and released it while it was speculating
    assert 3 not in ctl.sampled_by_pool_idx
    ctl.record_draft_logits([3], torch.zeros(1, 8))  # the row's next request is untouched
    assert len(st.draft_logits) == ctl.max_sampled_tokens + 1


def test_unpack_aux_never_reads_past_the_blob():
    blob = pack_aux([b"abc"])
    for cut in range(1, len(blob)):
        with pytest.raises(KVStreamError, match="truncated"):
            unpack_aux(blob[:cut])
    assert unpack_aux(np.zeros(0, np.uint8).tobytes()) == []


def _sender(cfg, pool, endpoint, staging, region, where, tokens, reports):
    """A PrefillSender on `endpoint` whose room r goes to `where[r]`, reporting into `reports`
    (room -> (when, failure)); its loop runs in `LoopThread(sender.run)`."""
    from lynx_sglang.backend.prefill.link import Destination, PrefillLink
    from lynx_sglang.backend.prefill.sender import PrefillSender

    link = PrefillLink(
        is_live=lambda room: True,
        destinations=lambda room: [Destination(where[room], tokens, ("x", 0))],
        read_aux=lambda index: b"",
        report=lambda room, failure, targets: reports.setdefault(
            room, (time.monotonic(), failure)))
    sender = PrefillSender(cfg, lambda: pool, staging, region, endpoint,
                           Claimant(Identity("127.0.0.1", 1), RankKey()), link,
                           Recorder.for_process())
    return sender


def test_a_dead_decode_does_not_stall_the_transfers_to_another():
    """Rooms bound for a decode that never answers wait (and fail) on their own worker; a room for
    a live decode, submitted after them, goes out at once; and once a connect has failed, the
    next room for the dead decode fails at once instead of waiting out the connect timeout."""
    import socket

    from lynx_sglang.backend.plan import StreamPlan
    from lynx_sglang.backend.pool import KVPoolView
    from lynx_sglang.backend.staging import StagingPool
    from lynx_transport import Endpoint, Stream

    layers, heads, dim, tokens = 2, 2, 64, 100
    cfg = LynxConfig.build(connect_timeout_s=2.0, transfer_timeout_s=10.0, staging_mib=4,
                           target="int8")
    pool = KVPoolView([torch.randn(256, heads, dim) for _ in range(layers)],
                      [torch.randn(256, heads, dim) for _ in range(layers)])
    dead = socket.socket()  # listens, never answers a handshake
    dead.bind(("127.0.0.1", 0))
    dead.listen(8)
    dead_address = f"tcp://127.0.0.1:{dead.getsockname()[1]}"
    reports: dict[int, tuple[float, str | None]] = {}
    with Endpoint(host="127.0.0.1") as dec, Endpoint(host="127.0.0.1") as pre:
        dec_staging = StagingPool(4 << 20, Metrics())
        region = dec.register(dec_staging.buffer)
        pre_staging = StagingPool(4 << 20, Metrics())
        pre_region = pre.register(pre_staging.buffer)
        plan = StreamPlan.build(cfg.codec, pool.shape, tokens, cfg.chunk_tokens)
        where = {1: dead_address, 2: dec.address, 3: dead_address}
        sender = _sender(cfg, pool, pre, pre_staging, pre_region, where, tokens, reports)
        with closing(dead), LoopThread(sender.run):
            slots = torch.arange(tokens)
            t0 = time.monotonic()
            sender.submit(1, slots, True, 0)
            sender.submit(2, slots, True, 0)
            session = dec.accept(timeout=5)
            assert session is not None
            session.announce(IDENTITY_REQUEST, {}, meta=b'{"accepted": true}')
            r = dec_staging.try_allocate(plan.staging_bytes)
            session.announce(2, {Stream.ANCHOR: [(region.id, r.offset, plan.anchor_bytes)],
                                 Stream.RESIDUAL: [(region.id, r.offset + plan.anchor_bytes,
                                                    plan.residual_bytes)]})
            assert session.wait(2, Stream.RESIDUAL, timeout=5).ok
            while 2 not in reports or 1 not in reports:
                assert time.monotonic() - t0 < 10
                time.sleep(0.01)
            assert reports[2][1] is None and reports[2][0] - t0 < 1.5  # not behind room 1
            assert reports[1][1] and reports[1][0] - t0 >= 1.5  # waited out its own connect
            t1 = time.monotonic()
            sender.submit(3, slots, True, 0)
            while 3 not in reports:
                time.sleep(0.01)
            assert "unreachable" in reports[3][1] and reports[3][0] - t1 < 0.5


def test_a_decode_that_never_answers_the_identity_gets_its_session_closed():
    """The prefill connected, but the decode never answered its identity (a stalled decode): the
    room fails after the connect timeout and the prefill closes that session rather than leave
    it, and its sockets, open until the peer dies (the fault matrix's stalled decode)."""
    from lynx_sglang.backend.pool import KVPoolView
    from lynx_sglang.backend.staging import StagingPool
    from lynx_transport import Endpoint

    tokens = 100
    cfg = LynxConfig.build(connect_timeout_s=1.0, transfer_timeout_s=10.0, staging_mib=4,
                           target="int8")
    pool = KVPoolView([torch.randn(256, 2, 64)], [torch.randn(256, 2, 64)])
    reports: dict[int, tuple[float, str | None]] = {}
    with Endpoint(host="127.0.0.1") as dec, Endpoint(host="127.0.0.1") as pre:
        staging = StagingPool(4 << 20, Metrics())
        sender = _sender(cfg, pool, pre, staging, pre.register(staging.buffer), {1: dec.address},
                         tokens, reports)
        with LoopThread(sender.run):
            sender.submit(1, torch.arange(tokens), True, 0)
            session = dec.accept(timeout=5)  # accepted; its identity is never answered
            assert session is not None
            t0 = time.monotonic()
            while 1 not in reports:
                assert time.monotonic() - t0 < 10
                time.sleep(0.01)
            assert reports[1][1] and "announcement" in reports[1][1]
            while not session.closed and time.monotonic() - t0 < 5:
                time.sleep(0.05)
            assert session.closed
