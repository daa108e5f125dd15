"""A request through Lynx's prefill and decode KV managers with SGLang's own machinery in one
process (conn_pair.py): the KV arrives in the decode's pool bit-exact (or as the INT8
reconstruction for target int8) with SGLang's metadata row, only the request's slots are written,
SGLang's transfer metric counts the bytes Lynx sent, and both staging ranges are given back; not
speculating, Success waits for the Residual (even when the prefill's Success or the end of the
Residual stream comes late); speculating, Success comes at Anchor time and the Residual's outcome
goes to `residual_outcome`; over TLS the KV arrives exact, and TLS or codec settings that differ
between the two sides fail both at connect, naming the flag; each manager composes the runtime
its hooks find on the KV pool.

The tests marked `rdma_vm` run over tcp on the host and over verbs inside the soft-RoCE guest
(conn_pair's LYNX_RDMA_VM / LYNX_RDMA_DEVICE).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from conn_pair import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    LONG_HOLD_S,
    LOOPBACK,
    NUM_TOKENS,
    POOL_TOKENS,
    RESIDUAL_HOLD_S,
    anchor_in,
    expected_kv,
    failure_message,
    holds,
    let_residual_go_after_release,
    make_cfg,
    poll_until_done,
    prefill_staging_free,
    start_request,
    wait_for,
)

from lynx_sglang.backend.plan import StreamPlan
from lynx_transport import Stream

pytestmark = pytest.mark.sglang


@pytest.mark.rdma_vm
@pytest.mark.parametrize("target", ["exact", "int8"])
def test_one_request(sgl, make_pd, target):
    pd = make_pd(make_cfg(target=target))
    untouched = torch.ones(POOL_TOKENS + 1, dtype=torch.bool)  # the pool has a padding slot 0
    before = [t.clone() for t in pd.decode.pool.k_buffer + pd.decode.pool.v_buffer]
    req = start_request(sgl, pd, room=1001, seed=1)
    untouched[req.decode_slots] = False

    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    # SGLang's transfer metric (sglang:kv_transfer_total_mb) counts the bytes Lynx sent, not
    # the pool bytes of the slots; read once.
    plan = StreamPlan.build(pd.prefill.mgr.lynx.codec, pd.prefill.mgr.pool.shape, NUM_TOKENS,
                            pd.prefill.mgr.lynx.chunk_tokens)
    sent = req.sender.get_transfer_metric().transfer_total_bytes
    pool_bytes = NUM_TOKENS * LAYERS * 2 * HEADS * HEAD_DIM * pd.prefill.pool.k_buffer[0].element_size()
    if target == "int8":
        assert sent == plan.anchor_bytes + plan.residual_bytes
    else:
        assert plan.anchor_bytes < sent <= plan.anchor_bytes + plan.residual_bytes
    assert sent != pool_bytes
    assert req.sender.get_transfer_metric().transfer_total_bytes == pool_bytes
    if target == "exact":
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                src = getattr(pd.prefill.pool, kind)[layer][req.prefill_slots]
                dst = getattr(pd.decode.pool, kind)[layer][req.decode_slots]
                assert torch.equal(dst, src), (kind, layer)
    else:
        for got, want in expected_kv(pd, req, "full"):
            assert torch.equal(got, want)
        # INT8 is lossy: the test would pass vacuously if the pool held the source values.
        assert not torch.equal(pd.decode.pool.k_buffer[0][req.decode_slots],
                               pd.prefill.pool.k_buffer[0][req.prefill_slots])
    after = pd.decode.pool.k_buffer + pd.decode.pool.v_buffer
    for t_before, t_after in zip(before, after, strict=True):
        assert torch.equal(t_after[untouched], t_before[untouched])
    # SGLang's metadata row (first output token, bootstrap room, ...) arrived with the KV.
    src, dst = pd.prefill.meta, pd.decode.meta
    for name in ("output_ids", "cached_tokens", "output_token_logprobs_val", "bootstrap_room"):
        assert torch.equal(getattr(dst, name)[req.decode_aux],
                           getattr(src, name)[req.prefill_aux]), name
    assert int(dst.bootstrap_room[req.decode_aux, 0]) == req.room
    # Both staging ranges are given back once the room is done.
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


def test_a_late_end_of_residual_still_succeeds(sgl, make_pd, monkeypatch):
    """Every Residual byte may land before the prefill marks the stream finished (its thread
    descheduled under load). The decode must wait for that end before it lets the room go: it
    used to release the announcement at once, and the prefill's finish a moment later found no
    live announcement and failed a request whose KV was complete (2 of 64 concurrent requests in
    `lynx-sglang load`)."""
    from lynx_transport.session import Session

    finish = Session.finish

    def late_residual_end(self, request_id, stream, aux=b""):
        if Stream(stream) is Stream.RESIDUAL:
            time.sleep(0.5)
        return finish(self, request_id, stream, aux)

    monkeypatch.setattr(Session, "finish", late_residual_end)
    pd = make_pd(make_cfg(target="exact"))
    req = start_request(sgl, pd, room=1011, seed=11)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for got, src in expected_kv(pd, req, "full"):
        assert torch.equal(got, src)


@pytest.mark.rdma_vm
def test_success_waits_for_the_residual(sgl, make_pd):
    """The prefill's Success reaching the decode early (here: sent by the test over SGLang's
    control plane while the prefill holds the Residual back) must not make the room Success
    before the Residual is in the KV pool."""
    pd = make_pd(make_cfg(target="exact"), residual_hold_s=RESIDUAL_HOLD_S)
    req = start_request(sgl, pd, room=2002, seed=2)
    wait_for("the whole Anchor at the decode", lambda: anchor_in(pd, req))
    assert req.receiver.poll() != sgl.KVPoll.Success
    assert not holds(pd, req, "anchor")  # not speculating: the Anchor is never written

    prefill = pd.prefill.mgr
    targets = [(i.endpoint, i.dst_port) for i in prefill.transfer_infos[req.room].values()]
    prefill.send_kv_status_message(targets=targets, bootstrap_room=req.room,
                                   status=sgl.KVPoll.Success)
    wait_for("the decode to take the prefill's Success",
          lambda: pd.decode.mgr.prefill_response_tracker.get(req.room))
    held = 0
    while True:
        status = req.receiver.poll()  # before the pool: Success must imply full precision
        full = holds(pd, req, "full")
        if status == sgl.KVPoll.Success:
            assert full, "Success reported while the decode pool holds Anchor-precision KV"
            break
        assert status != sgl.KVPoll.Failed, failure_message(sgl, req.receiver)
        held += not full
        time.sleep(0.005)
    assert held, "the Residual was applied before the test could poll; raise RESIDUAL_HOLD_S"
    for got, src in expected_kv(pd, req, "full"):
        assert torch.equal(got, src)


@pytest.mark.parametrize("then", ["applied", "prefill_dies", "cancelled"])
def test_speculative_success_at_anchor_time(sgl, make_pd, then):
    """Speculative mode (the default): the room is Success for SGLang once the Anchor and the aux
    data are in the pool; the Residual goes on after SGLang has cleared the receiver, and its
    outcome is reported to the speculation controller (`residual_outcome`), not to SGLang."""
    from lynx_sglang.backend.decode.outcome import ResidualState

    # Held until the test lets it go (`FaultPlan.release`), so no timing margin is needed
    # for the checks below, however loaded the machine; the hold's own bound is only a backstop.
    pd = make_pd(make_cfg(target="exact", speculate=True, spec_policy="always",
                      transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    faults = pd.prefill.mgr.sender.faults
    decode = pd.decode.mgr.applier
    req = start_request(sgl, pd, room=6006, seed=7)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert holds(pd, req, "anchor")
    assert torch.equal(pd.decode.meta.output_ids[req.decode_aux],
                       pd.prefill.meta.output_ids[req.prefill_aux])
    assert decode.residual_outcome(req.room).state is ResidualState.PENDING
    req.receiver.clear()  # SGLang commits the request to its running batch
    staging = pd.decode.mgr.staging
    assert staging.free_bytes() < staging.nbytes  # the Residual is still expected
    # SGLang no longer polls the room: the outcome must wake the scheduler's idle wait itself.
    woken: list[int] = []
    reporter = decode.reporter
    reporter.link = replace(reporter.link, progress=lambda: woken.append(req.room))

    if then == "applied":
        faults.release()
        outcome = wait_for("the Residual outcome", lambda: (
            o if (o := decode.residual_outcome(req.room)).state is not ResidualState.PENDING
            else None))
        assert outcome.state is ResidualState.APPLIED, outcome
        wait_for("the applied Residual to wake the scheduler", lambda: woken)
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                                   getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
        decode.forget(req.room)
        assert decode.residual_outcome(req.room) is None
    elif then == "prefill_dies":
        pd.prefill.mgr.endpoint.close()
        outcome = wait_for("the Residual outcome", lambda: (
            o if (o := decode.residual_outcome(req.room)).state is not ResidualState.PENDING
            else None))
        assert outcome.state is ResidualState.FAILED, outcome
        assert "Residual stream failed" in outcome.reason, outcome
        wait_for("the failed Residual to wake the scheduler", lambda: woken)
        assert holds(pd, req, "anchor")
    else:
        # The request's KV slots are being freed: nothing may be written into them afterwards.
        assert decode.cancel(req.room)
        assert decode.residual_outcome(req.room) is None
        let_residual_go_after_release(pd, req)
        assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed  # its Residual is refused
        assert holds(pd, req, "anchor")
    assert staging.free_bytes() == staging.nbytes


@pytest.mark.parametrize("field, prefill_value, decode_value, flag", [
    ("target", "exact", "int8", "--lynx-target"),  # different stream sizes
    ("rotate", True, False, "--lynx-rotate"),  # same sizes: only the settings tell
    # The prefill would pick widths the decode's staging and checks do not take.
    ("anchor_width", "adaptive", "fixed", "--lynx-anchor-width"),
])
def test_codec_mismatch_fails_both_sides_at_connect(sgl, make_pd, field, prefill_value,
                                                    decode_value, flag):
    """The prefill sends its wire settings when it opens the session; the decode refuses the
    session once, naming the flag, and both sides' requests fail with that reason."""
    pd = make_pd(make_cfg(**{field: prefill_value}), make_cfg(**{field: decode_value}))
    req = start_request(sgl, pd, room=3003, seed=3)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    expect = f"{flag}: prefill {prefill_value!r}, decode {decode_value!r}"
    assert expect in failure_message(sgl, req.sender)
    decode_msg = failure_message(sgl, req.receiver)
    assert expect in decode_msg, decode_msg
    # failure_exception() cleared the receiver: nothing of the room is left in decode staging.
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert not holds(pd, req, "full")


@pytest.fixture(scope="module")
def tls_flags(tmp_path_factory) -> dict:
    from lynx_tools.cluster.tls_certs import make_certs

    files = make_certs(tmp_path_factory.mktemp("tls"), [LOOPBACK])
    return {"tls_cert": str(files.cert_file), "tls_key": str(files.key_file),
            "tls_ca": str(files.ca_file)}


def test_a_request_over_tls_arrives_bit_exact(sgl, make_pd, tls_flags):
    pd = make_pd(make_cfg(target="exact", **tls_flags))
    req = start_request(sgl, pd, room=3101, seed=31)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
    backend = pd.decode.mgr.endpoint.backend
    assert backend.local_info()["tls"] is True
    assert all(len(ts.socks) == 4 for ts in backend._sessions.values())


def test_tls_on_one_side_only_fails_both_sides_naming_the_flags(sgl, make_pd, tls_flags):
    pd = make_pd(make_cfg(), make_cfg(**tls_flags))
    req = start_request(sgl, pd, room=3102, seed=32)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    for party in (req.sender, req.receiver):
        message = failure_message(sgl, party)
        assert "TLS" in message and "--lynx-tls-cert" in message, message
    # failure_exception() cleared the receiver: nothing of the room is left in decode staging.
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


def test_the_manager_composes_the_runtime_its_hooks_find(sgl, make_pd):
    """Once SGLang hands it the KV pool, each manager holds its role's components in one
    `LynxRuntime`, attached to that pool too: where the hooks inside the model and the KV cache
    find it (here the pool's own `set_kv_buffer` hook, opening a layer-streamed forward's gate)."""
    from types import SimpleNamespace

    from lynx_sglang import hooks, runtime
    from lynx_sglang.backend.prefill.layer_stream import LayerGate

    pd = make_pd(make_cfg(), make_cfg(speculate=True))
    for side in (pd.prefill, pd.decode):
        assert runtime.of_kv_pool(side.pool) is side.mgr.lynx_runtime
    prefill, decode = pd.prefill.mgr.lynx_runtime, pd.decode.mgr.lynx_runtime
    assert prefill.sender is pd.prefill.mgr.sender and prefill.spec is None
    assert prefill.layer_stream is not None  # a CPU pool
    assert decode.sender is None and decode.layer_stream is None
    assert decode.spec is not None and decode.spec.transfers is pd.decode.mgr.applier
    assert prefill.idle is not decode.idle
    prefill.layer_stream.gate = gate = LayerGate(LAYERS)
    hooks.set_kv_buffer_after(None, pd.prefill.pool, SimpleNamespace(layer_id=1))
    assert gate.opened == 2
    prefill.layer_stream.gate = None
