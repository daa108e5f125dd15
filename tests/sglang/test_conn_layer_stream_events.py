"""Layer streaming's CUDA code path with the real room writer (`backend.prefill.writer`) between
Lynx's prefill and decode KV managers in one process (conn_pair.py, a CPU pool): the gate holds a
stand-in event per layer, as `LayerStreamer` stores a CUDA event recorded after the layer's KV
write, and the writer sends layer l only once its event has completed, though the gate is open to
the last layer. The streamer's side is in test_layer_stream_events.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conn_pair import (
    LAYERS,
    NUM_TOKENS,
    failure_message,
    forward_layer,
    holds,
    make_cfg,
    open_request,
    poll_until_done,
    wait_for,
)

from lynx_sglang.backend.prefill.layer_stream import LayerGate

pytestmark = pytest.mark.sglang


class HeldEvent:
    """A CUDA event whose stream has not run the layer's write yet, until `complete`."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def record(self) -> None:
        """Recorded by the test, which stands for the forward."""

    def query(self) -> bool:
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()


def _anchor_layers_landed(pd, room: int) -> int:
    r = pd.decode.mgr.applier.rooms.get(room)
    return 0 if r is None else r.progress.anchor_layers_landed


def test_the_writer_sends_a_layer_only_once_its_event_has_completed(sgl, make_pd):
    pd = make_pd(make_cfg(target="exact"))
    req, g = open_request(sgl, pd, room=1201, seed=31)
    gate = LayerGate(LAYERS)
    assert pd.prefill.mgr.sender.start_early(
        [(req.room, req.prefill_slots.numpy().astype("int64"))], gate) == {req.room}
    events = [HeldEvent() for _ in range(LAYERS)]
    # The forward queued every layer: the gate is open to the last, no event has completed.
    for layer in range(LAYERS):
        forward_layer(pd, req, layer, g)
        gate.written(layer, events[layer])
    time.sleep(0.3)
    assert _anchor_layers_landed(pd, req.room) == 0
    for layer in range(LAYERS - 1):
        events[layer].complete()
        wait_for(f"layer {layer}'s Anchor at the decode",
                 lambda n=layer + 1: _anchor_layers_landed(pd, req.room) == n)
    time.sleep(0.2)
    assert _anchor_layers_landed(pd, req.room) == LAYERS - 1
    events[-1].complete()
    gate.finish()
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None, num_kv_tokens=NUM_TOKENS)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success, \
        failure_message(sgl, req.receiver)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    assert holds(pd, req, "full")
