"""Layer streaming (backend.prefill.layer_stream) between Lynx's prefill and decode KV managers with
SGLang's own machinery in one process (conn_pair.py): the Anchor and Residual of the layers a
forward has written go out while it runs, the rooms of one forward (or of one batch result)
stream together without one room's Residual holding back another's Anchor, a room handed over
only after the next forward has started and written its layers (SGLang's overlap scheduler) is
sent exact beside that forward's room, a windowed room in such a group goes after the forward,
the transfer timeout is a stall deadline, and a failed forward or an abort during it fails only
its room with nothing held. Slots SGLang's prefix cache swaps in after the forward are taken
when they hold the same bits, and the forward's own rows are sent when they do not.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from conn_pair import (
    LAYERS,
    NUM_TOKENS,
    PD,
    POOL_TOKENS,
    RESIDUAL_HOLD_S,
    Request,
    SGLang,
    anchor_in,
    expected_kv,
    failure_message,
    forward_and_send,
    forward_layer,
    holds,
    make_cfg,
    open_request,
    poll_until_done,
    prefill_staging_free,
    wait_for,
)

pytestmark = pytest.mark.sglang


def _start_streamed_request(sgl: SGLang, pd: PD, room: int, seed: int):
    """`start_request` as a layer-streamed prefill drives it: the room is handed to the sender
    with a gate before its "forward" has written any KV; the caller writes the layers
    (`forward_layer`), opens the gate and hands the room over (`sender.send`)."""
    from lynx_sglang.backend.prefill.layer_stream import LayerGate

    req, g = open_request(sgl, pd, room, seed)
    gate = LayerGate(LAYERS)
    assert pd.prefill.mgr.sender.start_early(
        [(room, req.prefill_slots.numpy().astype("int64"))], gate) == {room}
    return req, gate, g


def _anchor_layers_landed(pd: PD, room: int) -> int:
    r = pd.decode.mgr.applier.rooms.get(room)
    return 0 if r is None else r.progress.anchor_layers_landed


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_a_layer_streamed_anchor_lands_before_the_forward_ends(sgl, make_pd, target):
    """Layers written so far are sent at once, Anchor and Residual: the decode holds the first
    layers at full precision while the last layer is still being computed, and the room ends
    bit-exact (int8: the INT8 reconstruction) once handed over."""
    pd = make_pd(make_cfg(target=target))
    req, gate, g = _start_streamed_request(sgl, pd, room=1101, seed=21)
    for layer in range(LAYERS - 1):
        forward_layer(pd, req, layer, g)
        gate.written(layer)
    wait_for("the first layers' Anchor at the decode",
          lambda: _anchor_layers_landed(pd, req.room) == LAYERS - 1)
    # Their Residual went with them: those layers are at full precision in the pool already.
    wait_for("the first layers' Residual applied at the decode",
          lambda: pd.decode.mgr.applier.rooms.get(req.room).progress.final_layers == LAYERS - 1)
    # Not a layer more than the forward wrote, and no Success before the hand-over.
    time.sleep(0.2)
    assert _anchor_layers_landed(pd, req.room) == LAYERS - 1
    assert pd.decode.mgr.applier.rooms.get(req.room).progress.final_layers == LAYERS - 1
    assert req.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    forward_layer(pd, req, LAYERS - 1, g)
    gate.finish()
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    assert holds(pd, req, "full")
    if target == "exact":
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                                   getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
    assert int(pd.decode.meta.bootstrap_room[req.decode_aux, 0]) == req.room
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_layer_streamed_forward_longer_than_the_transfer_timeout_succeeds(sgl, make_pd):
    """The transfer timeout is a stall deadline: a forward that writes a layer every 1.2 s with a
    2 s timeout keeps its room alive for far longer than 2 s in all. (Before, the deadline ran
    from the first landed byte: a long prompt's forward failed its own transfer.)"""
    timeout_s, gap_s = 2.0, 1.2
    pd = make_pd(make_cfg(target="exact", transfer_timeout_s=timeout_s))
    req, gate, g = _start_streamed_request(sgl, pd, room=1103, seed=23)
    t0 = time.monotonic()
    for layer in range(LAYERS):
        forward_layer(pd, req, layer, g)
        gate.written(layer)
        time.sleep(gap_s)
    gate.finish()
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    assert time.monotonic() - t0 > timeout_s + 0.2
    assert holds(pd, req, "full")


def _all_succeed(sgl: SGLang, pd: PD, reqs) -> None:
    """Each request ends Success on both sides with the prefill's exact KV in the decode pool."""
    for req in reqs:
        assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
            failure_message(sgl, req.receiver)
        assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
        assert holds(pd, req, "full")


def _stream_two_rooms(sgl: SGLang, pd: PD, rooms: tuple[int, int], seed: int):
    """Two requests whose prompts one forward computes, handed to the sender with one gate; the
    forward writes layer 0 of both. Returns them (with their generators) and the gate once layer
    0 of both rooms is at the decode."""
    from lynx_sglang.backend.prefill.layer_stream import LayerGate

    a, ga = open_request(sgl, pd, room=rooms[0], seed=seed)
    b, gb = open_request(sgl, pd, room=rooms[1], seed=seed + 1, beside=(a,))
    gate = LayerGate(LAYERS)
    assert pd.prefill.mgr.sender.start_early(
        [(r.room, r.prefill_slots.numpy().astype("int64")) for r in (a, b)], gate) == set(rooms)
    for req, g in ((a, ga), (b, gb)):
        forward_layer(pd, req, 0, g)
    gate.written(0)
    wait_for("the first layer of both rooms at the decode",
          lambda: _anchor_layers_landed(pd, a.room) == _anchor_layers_landed(pd, b.room) == 1)
    return (a, ga), (b, gb), gate


def test_the_rooms_of_one_forward_stream_their_layers_together(sgl, make_pd):
    """Two rooms computed by one forward and bound for one decode go to its worker as one group:
    each layer goes out for both as the forward writes it (`_stream_two_rooms` waits for layer 0
    of both before the forward goes on). Sent one room after the other, the second room's first
    layer would wait for the first room's hand-over after the forward."""
    pd = make_pd(make_cfg(target="exact"))
    (a, ga), (b, gb), gate = _stream_two_rooms(sgl, pd, (1111, 1112), seed=31)
    for req, g in ((a, ga), (b, gb)):
        forward_layer(pd, req, 1, g)
    gate.finish()
    for req in (a, b):
        req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    _all_succeed(sgl, pd, (a, b))
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_room_that_fails_in_a_streamed_group_leaves_the_others(sgl, make_pd):
    """One room of a layer-streamed group dropped by SGLang during the forward fails alone; the
    other room of the group is sent whole."""
    pd = make_pd(make_cfg(target="exact"))
    (a, ga), (b, gb), gate = _stream_two_rooms(sgl, pd, (1113, 1114), seed=33)
    a.sender.abort()
    for req, g in ((a, ga), (b, gb)):
        forward_layer(pd, req, 1, g)
    gate.finish()
    b.sender.send(b.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert poll_until_done(sgl, b.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, b.receiver)
    assert poll_until_done(sgl, b.sender) == sgl.KVPoll.Success
    assert poll_until_done(sgl, a.receiver) == sgl.KVPoll.Failed
    failure_message(sgl, a.receiver)
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_room_handed_over_after_the_next_forward_started_is_sent_exact(sgl, make_pd):
    """SGLang's overlap scheduler processes forward N's results, and so hands its room over,
    only after it has launched forward N+1 (on CPU: run it). Forward N's room has its layers
    sent and waits for the hand-over while N+1 streams its own room behind a gate of its own;
    both rooms end exact, whichever gate opens or which room is handed over first."""
    from lynx_sglang.backend.prefill.layer_stream import LayerGate

    pd = make_pd(make_cfg(target="exact"))
    sender = pd.prefill.mgr.sender
    a, gate_a, ga = _start_streamed_request(sgl, pd, room=1151, seed=71)
    for layer in range(LAYERS):
        forward_layer(pd, a, layer, ga)
        gate_a.written(layer)
    gate_a.finish()
    wait_for("forward N's Anchor layers at the decode",
             lambda: _anchor_layers_landed(pd, a.room) == LAYERS)
    # Forward N+1 starts before N's room is handed over, and writes its layers.
    b, gb = open_request(sgl, pd, room=1152, seed=72, beside=(a,))
    gate_b = LayerGate(LAYERS)
    assert sender.start_early([(b.room, b.prefill_slots.numpy().astype("int64"))],
                              gate_b) == {b.room}
    assert sender.tracked()["prefill_rooms_streaming"] == 2
    for layer in range(LAYERS - 1):
        forward_layer(pd, b, layer, gb)
        gate_b.written(layer)
    time.sleep(0.2)
    assert a.receiver.poll() not in (sgl.KVPoll.Success, sgl.KVPoll.Failed)
    # N's results: its room handed over while N+1 still runs.
    a.sender.send(a.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    forward_layer(pd, b, LAYERS - 1, gb)
    gate_b.finish()
    b.sender.send(b.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    _all_succeed(sgl, pd, (a, b))
    for req in (a, b):
        for kind in ("k_buffer", "v_buffer"):
            for layer in range(LAYERS):
                assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                                   getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_streamed_group_whose_second_room_waits_for_prefill_staging_sends_both(sgl, make_pd):
    """The prefill's staging holds one room of a two-room group until another holder lets go:
    while the second room waits for its range, the first (opened, nothing written yet) keeps its
    range and its announcement, and both rooms then arrive exact. (Reaping the first room as
    delivered there gave its range away and abandoned the whole group: its rooms hung until
    SGLang's abort.)"""
    from lynx_sglang.backend.plan import StreamPlan
    from lynx_sglang.backend.prefill.layer_stream import LayerGate
    from lynx_sglang.backend.staging import ALIGN as STAGING_ALIGN

    pd = make_pd(make_cfg(target="exact"))
    prefill = pd.prefill.mgr
    plan = StreamPlan.build(prefill.lynx.codec, prefill.pool.shape, NUM_TOKENS,
                            prefill.lynx.chunk_tokens)
    one_room = -(-plan.staging_bytes // STAGING_ALIGN) * STAGING_ALIGN
    holder = prefill.staging.try_allocate(prefill.staging.nbytes - one_room)
    assert holder is not None
    let_go = threading.Timer(1.0, prefill.staging.free, (holder,))
    let_go.start()
    try:
        a, ga = open_request(sgl, pd, room=1141, seed=61)
        b, gb = open_request(sgl, pd, room=1142, seed=62, beside=(a,))
        gate = LayerGate(LAYERS)
        assert prefill.sender.start_early(
            [(r.room, r.prefill_slots.numpy().astype("int64")) for r in (a, b)],
            gate) == {1141, 1142}
        for layer in range(LAYERS):
            for req, g in ((a, ga), (b, gb)):
                forward_layer(pd, req, layer, g)
            gate.written(layer)
        gate.finish()
        for req in (a, b):
            req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                            num_kv_tokens=NUM_TOKENS)
        _all_succeed(sgl, pd, (a, b))
    finally:
        let_go.join()
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert prefill.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_windowed_room_in_a_layer_streamed_group_goes_after_the_forward(sgl, make_pd, caplog):
    """One forward computes an ordinary room and one too large for the decode's staging: the
    ordinary room streams its layers during the forward, the windowed one waits for the hand-over
    and goes in segments after it (`_WindowedWriter`). Both arrive exact, and every byte of
    staging comes back on both sides."""
    from lynx_sglang.backend.prefill.layer_stream import LayerGate

    pd = make_pd(make_cfg(target="exact", staging_mib=1))
    decode = pd.decode.mgr
    gate = LayerGate(LAYERS)
    with caplog.at_level(logging.INFO, logger="lynx_sglang.backend.decode.admission"):
        # 800 tokens: past the 781 that 1 MiB of staging holds whole; both fit the test's pool.
        a, ga = open_request(sgl, pd, room=1131, seed=51, tokens=200)
        b, gb = open_request(sgl, pd, room=1132, seed=52, beside=(a,), tokens=800)
        assert pd.prefill.mgr.sender.start_early(
            [(r.room, r.prefill_slots.numpy().astype("int64")) for r in (a, b)], gate) == {1131,
                                                                                          1132}
        forward_layer(pd, a, 0, ga)
        forward_layer(pd, b, 0, gb)
        gate.written(0)
        wait_for("the ordinary room's first layer at the decode",
              lambda: _anchor_layers_landed(pd, a.room) == 1)
        assert _anchor_layers_landed(pd, b.room) == 0  # the windowed room waits for the forward
        forward_layer(pd, a, 1, ga)
        forward_layer(pd, b, 1, gb)
        gate.finish()
        for req in (a, b):
            req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                            num_kv_tokens=len(req.prefill_slots))
        _all_succeed(sgl, pd, (a, b))
    assert "room 1132 needs" in caplog.text and "sent in 2 segments" in caplog.text
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][b.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][b.prefill_slots])
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert decode.staging.free_bytes() == decode.staging.nbytes
    assert decode.applier.tracked()["decode_rooms"] == 0
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def _residual_in(pd: PD, req: Request) -> bool:
    room = pd.decode.mgr.applier.rooms.get(req.room)
    return room is not None and room.progress.final_layers == LAYERS


def test_rooms_handed_over_together_send_every_anchor_before_a_residual(sgl, make_pd):
    """Rooms SGLang hands over while handling one forward's results (`PrefillSender.batched`,
    as the `process_batch_result` hook runs it, finding the sender through the scheduler's
    prefill queue) go to their decode's worker as one group: the second room's Anchor does not
    wait for the first room's Residual (here held back 2 s)."""
    from types import SimpleNamespace

    from lynx_sglang import hooks

    pd = make_pd(make_cfg(target="exact"), residual_hold_s=RESIDUAL_HOLD_S)
    a, ga = open_request(sgl, pd, room=1121, seed=41)
    b, gb = open_request(sgl, pd, room=1122, seed=42, beside=(a,))
    for req, g in ((a, ga), (b, gb)):
        for layer in range(LAYERS):
            forward_layer(pd, req, layer, g)

    def process_batch_result(scheduler):
        for req in (a, b):
            req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                            num_kv_tokens=NUM_TOKENS)

    scheduler = SimpleNamespace(
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=pd.prefill.mgr))
    hooks.process_batch_result_around(process_batch_result, scheduler)
    wait_for("both Anchors at the decode", lambda: anchor_in(pd, a) and anchor_in(pd, b))
    assert not _residual_in(pd, a), "the first room's Residual came before the second's Anchor"
    _all_succeed(sgl, pd, (a, b))
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))


def test_a_failed_forward_fails_the_layer_streamed_room(sgl, make_pd):
    pd = make_pd(make_cfg(target="exact"))
    req, gate, g = _start_streamed_request(sgl, pd, room=1102, seed=22)
    forward_layer(pd, req, 0, g)
    gate.written(0)
    gate.fail("RuntimeError: out of memory")
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Failed
    assert "forward failed before layer 1" in failure_message(sgl, req.sender)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    failure_message(sgl, req.receiver)  # SGLang's decode clears the room with it
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def _free_slots(req: Request, count: int) -> torch.Tensor:
    used = set(req.prefill_slots.tolist())
    return torch.tensor([s for s in range(1, POOL_TOKENS + 1) if s not in used][:count])


def _forward_then_swap_tail(pd: PD, req: Request, g: torch.Generator, count: int,
                            first_layer: int = 0) -> torch.Tensor:
    """The forward (its layers from `first_layer` on), then what SGLang's prefix cache does to its
    last `count` slots: the slots SGLang hands over, whose last `count` are other slots holding a
    copy of the same KV."""
    for layer in range(first_layer, LAYERS):
        forward_layer(pd, req, layer, g)
    swapped = req.prefill_slots.clone()
    swapped[-count:] = _free_slots(req, count)
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        for layer in range(LAYERS):
            buffers[layer][swapped[-count:]] = buffers[layer][req.prefill_slots[-count:]]
    return swapped


def test_slots_the_prefix_cache_swapped_for_the_same_kv_are_taken(sgl, make_pd):
    """After the forward SGLang's prefix cache may replace slots the forward wrote by cached ones
    holding the same tokens (and free the forward's). With the same bits in every layer the
    room goes on from the cached slots and ends bit-exact."""
    pd = make_pd(make_cfg(target="exact"))
    req, gate, g = _start_streamed_request(sgl, pd, room=1103, seed=23)
    swapped = _forward_then_swap_tail(pd, req, g, 3)
    gate.finish()
    req.sender.send(swapped.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    # SGLang frees the forward's own slots, which the next forward may write.
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        for layer in range(LAYERS):
            buffers[layer][req.prefill_slots[-3:]] = 0
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][swapped])


@pytest.mark.parametrize("target", ["exact", "int8"])
def test_slots_swapped_for_different_kv_are_sent_as_the_forward_wrote_them(sgl, make_pd, target,
                                                                             caplog):
    """The same swap with other bits in the cached slots (two requests computed the same tokens
    in different batches): the room is sent from copies of the forward's own rows, made before
    SGLang can write the freed slots again, so every layer at the decode is what the forward
    computed (the KV its first token came from, and the Anchor layers already sent)."""
    pd = make_pd(make_cfg(target=target))
    req, gate, g = _start_streamed_request(sgl, pd, room=1105, seed=25)
    # The first layer goes out before the swap, the others after it.
    forward_layer(pd, req, 0, g)
    gate.written(0)
    wait_for("layer 0's Anchor at the decode", lambda: _anchor_layers_landed(pd, req.room) == 1)
    swapped = _forward_then_swap_tail(pd, req, g, 2, first_layer=1)
    forward = {kind: [getattr(pd.prefill.pool, kind)[layer][req.prefill_slots].clone()
                      for layer in range(LAYERS)] for kind in ("k_buffer", "v_buffer")}
    for layer in (0, LAYERS - 1):
        pd.prefill.pool.v_buffer[layer][swapped[-1:]] += 1.0
    # Handed over while the sender still waits on layer 1 (a worker behind the forward).
    with caplog.at_level(logging.INFO, logger="lynx_sglang"):
        req.sender.send(swapped.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert "replaced 2 of the slots its forward wrote by cached ones holding other bits" \
        in caplog.text
    # SGLang frees the forward's own slots, and the next forward writes them.
    for buffers in (pd.prefill.pool.k_buffer, pd.prefill.pool.v_buffer):
        for layer in range(LAYERS):
            buffers[layer][req.prefill_slots[-2:]] = 7.0
    gate.finish()
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            landed = getattr(pd.decode.pool, kind)[layer][req.decode_slots]
            if target == "exact":
                assert torch.equal(landed, forward[kind][layer])
            else:
                assert not torch.equal(landed[-2:], torch.full_like(landed[-2:], 7.0))
    if target == "int8":
        # int8 lands the INT8 reconstruction: it is the forward's, not the cached rows'.
        cached = pd.prefill.pool.v_buffer[LAYERS - 1][swapped[-1:]]
        landed = pd.decode.pool.v_buffer[LAYERS - 1][req.decode_slots[-1:]]
        want = forward["v_buffer"][LAYERS - 1][-1:]
        assert (landed.float() - want.float()).abs().max() < \
            (landed.float() - cached.float()).abs().max()
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd))
    assert pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0


def test_a_request_aborted_during_its_forward_stops_streaming(sgl, make_pd, monkeypatch):
    """SGLang aborts a request whose client left while its forward ran, and frees its KV slots
    right after the forward: the streamed room stops reading them and fails as aborted (not as
    bad data), nothing is held."""
    from lynx_sglang.failures import FailureKind
    from lynx_sglang.metrics import Metrics

    kinds: list[FailureKind] = []
    monkeypatch.setattr(Metrics, "record_failure", lambda _, kind: kinds.append(kind))
    pd = make_pd(make_cfg(target="exact"))
    req, gate, g = _start_streamed_request(sgl, pd, room=1104, seed=24)
    forward_layer(pd, req, 0, g)
    gate.written(0)
    wait_for("layer 0's Anchor at the decode", lambda: _anchor_layers_landed(pd, req.room) == 1)
    req.sender.abort()
    for layer in range(1, LAYERS):
        forward_layer(pd, req, layer, g)
    gate.finish()
    wait_for("the streamed room to be given up",
          lambda: pd.prefill.mgr.sender.tracked()["prefill_rooms_streaming"] == 0, timeout=5.0)
    wait_for("the prefill staging to be freed", lambda: prefill_staging_free(pd), timeout=5.0)
    assert _anchor_layers_landed(pd, req.room) < LAYERS
    assert kinds and set(kinds) == {FailureKind.ABORTED}, kinds


def test_a_room_the_policy_does_not_stream_goes_after_its_forward_and_measures_the_link(
        sgl, make_pd, tmp_path):
    """With the default --lynx-layer-stream-min-share a decode's first room is not streamed
    (`start_early` leaves it to the usual path, nothing queued); sent after its forward it ends
    exact, and its Anchor's delivery is then what the policy knows of that decode's link. Its
    trace record has the transport's send marks (read before the request is released)."""
    from lynx_sglang.backend.prefill.layer_stream import LayerGate
    from lynx_sglang.trace import read_records

    pd = make_pd(make_cfg(target="exact", trace_dir=str(tmp_path)))
    sender = pd.prefill.mgr.sender
    req, g = open_request(sgl, pd, room=1301, seed=31)
    slots = req.prefill_slots.numpy().astype("int64")
    decode = sender.link.destinations(req.room)[0].session_address
    assert sender.stream_policy.link_s_per_byte(decode) is None
    assert sender.start_early([(req.room, slots)], LayerGate(LAYERS),
                              forward_tokens=NUM_TOKENS) == set()
    forward_and_send(pd, req, g)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    for got, want in expected_kv(pd, req, "full"):
        assert torch.equal(got, want)
    measured = wait_for("the Anchor's delivery measured",
                        lambda: sender.stream_policy.link_s_per_byte(decode))
    assert 0 < measured < 1e-3  # seconds per byte: in-process delivery takes milliseconds
    record = wait_for("the prefill's trace record", lambda: next(
        (r for r in read_records(tmp_path) if r["kind"] == "prefill" and r["room"] == req.room),
        None))
    assert {"anchor_first_sent", "anchor_acked", "residual_acked"} <= set(record["marks"])
