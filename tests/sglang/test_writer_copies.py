"""The room writer's overlap of a CUDA pool's device-to-host copies with the next layer's encode
(`backend.prefill.writer.RoomWriter`), run here without a GPU: the writer's encode is a stand-in
whose layers land only when the test says so (as `streams.PendingLayer` does once a copy stream
has run), and the session records what is written to the transport. What it protects: a layer
goes to the transport only after its bytes landed; with copies in flight a layer is written once
the next is encoded, but never held back while the writer waits for the forward; a CPU pool's
layers are written at once, as before; a failure waits for the copies in flight before the
room's staging can be given back. A windowed room's segments (`WindowedWriter`) overlap the same
way."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from lynx_kernels import CodecSpec, KVShape
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.prefill.faults import FaultPlan
from lynx_sglang.backend.prefill.layer_stream import LayerGate
from lynx_sglang.backend.prefill.writer import RoomWriter, WindowedWriter
from lynx_sglang.backend.staging import StagingRange
from lynx_sglang.config import LynxConfig
from lynx_sglang.trace import Trace
from lynx_transport import Stream

LAYERS = 4
WAIT_S = 10


class HeldLayer:
    """A layer encoded on the device whose copies land on `land` (`PendingLayer`'s interface)."""

    def __init__(self, log: list, layer: int, plan: StreamPlan, copying: bool):
        self.log, self.layer, self.copying = log, layer, copying
        self.plan = plan
        self.landed = threading.Event()
        self.finished = False
        if not copying:
            self.landed.set()

    def settle(self, timeout_s: float) -> None:
        self.finish(timeout_s)

    def finish(self, timeout_s: float) -> tuple[int, int]:
        if not self.landed.wait(timeout_s):
            raise TimeoutError("held")
        self.finished = True
        self.log.append(("landed", self.layer))
        return self.plan.anchor_layer_bytes, 100


class Refusing(Exception):
    """The transport refused a write."""


class Recorder:
    """Deps and session of one writer: the encodes it starts and what it writes, in order."""

    def __init__(self, plan: StreamPlan, copying: bool, fail_at: int | None = None,
                 refuse_write: int | None = None):
        self.plan, self.copying, self.fail_at = plan, copying, fail_at
        self.refuse_write = refuse_write
        self.log: list[tuple] = []
        self.layers: list[HeldLayer] = []
        self.config = LynxConfig()
        self.staging = SimpleNamespace(buffer=bytearray(plan.staging_bytes))
        self.staging_region = "region"
        self.faults = FaultPlan()
        self._layer_at = {plan.anchor_offset(layer): layer for layer in range(plan.num_layers)}

    # WriterDeps
    def start(self, job, pool, layer, anchor_out, residual_out, spec=None) -> HeldLayer:
        if layer == self.fail_at:
            raise RuntimeError(f"encode of layer {layer} failed")
        self.log.append(("start", layer))
        held = HeldLayer(self.log, layer, self.plan, self.copying)
        self.layers.append(held)
        return held

    def is_live(self, room: int) -> bool:
        return True

    def read_aux(self, index: int) -> bytes:
        return b""

    # Session
    def write_stream(self, room, stream, region, at, n, stream_offset) -> None:
        if stream is Stream.ANCHOR:
            layer = self._layer_at[stream_offset]
            if layer == self.refuse_write:
                raise Refusing(f"write of layer {layer} refused")
            self.log.append(("write", layer))
        else:  # each Residual layer from its own bound-sized place
            place = at - self.plan.anchor_bytes
            assert place % self.plan.residual_layer_bytes == 0
            self.log.append(("rwrite", place // self.plan.residual_layer_bytes, stream_offset))

    def finish(self, room, stream, aux=b"") -> None:
        self.log.append(("finish", stream.name))


def writer(copying: bool, gate: LayerGate | None = None, fail_at: int | None = None,
           refuse_write: int | None = None) -> tuple[RoomWriter, Recorder]:
    spec = CodecSpec(anchor_bits=4, group_size=64, target="exact", sink_tokens=4,
                     recent_tokens=16, rotate=True)
    plan = StreamPlan.build(spec, KVShape(LAYERS, 2, 64, torch.bfloat16), 300, 256)
    rec = Recorder(plan, copying, fail_at, refuse_write)
    job = SimpleNamespace(room=7, gate=gate, trace=Trace("prefill", 7), aux_index=0)
    return RoomWriter(rec, rec, job, None, StagingRange(0, plan.staging_bytes), plan), rec


def writes(log: list) -> list[int]:
    """The Anchor layers written, in order."""
    return [entry[1] for entry in log if entry[0] == "write"]


def test_with_copies_in_flight_a_layer_is_written_once_the_next_is_encoded():
    w, rec = writer(copying=True)
    for layer in range(LAYERS):
        w.layer(layer)
        if layer:
            assert rec.log[-2:] == [("landed", layer - 1), ("write", layer - 1)]
        rec.layers[-1].landed.set()  # the copies land while the writer returns to its loop
    assert rec.log[:3] == [("start", 0), ("start", 1), ("landed", 0)]
    w.finish_anchor()
    assert writes(rec.log) == list(range(LAYERS)) and rec.log[-1] == ("finish", "ANCHOR")
    for layer in range(LAYERS):  # each written after it landed and after the next one started
        assert rec.log.index(("landed", layer)) < rec.log.index(("write", layer))
        if layer + 1 < LAYERS:
            assert rec.log.index(("start", layer + 1)) < rec.log.index(("write", layer))


def test_a_layer_is_not_held_back_while_the_writer_waits_for_the_forward():
    gate = LayerGate(LAYERS)
    gate.written(0)
    w, rec = writer(copying=True, gate=gate)
    w.layer(0)
    rec.layers[0].landed.set()
    waiting = threading.Thread(target=w.layer, args=(1,))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive(), "layer 1 is not open: the writer must be waiting for the forward"
    assert writes(rec.log) == [0], "layer 0 held back while the forward computes layer 1"
    gate.written(1)
    waiting.join(WAIT_S)
    assert not waiting.is_alive() and rec.log[-1] == ("start", 1)


def test_a_cpu_pool_writes_each_layer_at_once():
    w, rec = writer(copying=False)
    for layer in range(LAYERS):
        w.layer(layer)
        assert rec.log[-3:] == [("start", layer), ("landed", layer), ("write", layer)]


def test_a_failure_waits_for_the_copies_in_flight():
    w, rec = writer(copying=True, fail_at=2)
    w.layer(0)
    rec.layers[0].landed.set()
    w.layer(1)
    threading.Timer(0.2, rec.layers[1].landed.set).start()
    with pytest.raises(RuntimeError, match="encode of layer 2 failed"):
        w.layer(2)
    assert rec.layers[1].finished, "the room failed with layer 1's copies still running"
    assert writes(rec.log) == [0], "a layer written after the room failed"


def test_a_refused_write_waits_for_the_layer_started_meanwhile():
    """Layer 1 is encoded (its copies in flight) when the transport refuses layer 0's write:
    the room fails only once layer 1's copies have landed."""
    w, rec = writer(copying=True, refuse_write=0)
    w.layer(0)
    rec.layers[0].landed.set()
    threading.Timer(0.2, lambda: rec.layers[1].landed.set()).start()
    with pytest.raises(Refusing):
        w.layer(1)
    assert rec.layers[1].finished, "the room failed with layer 1's copies still running"


@pytest.mark.parametrize("copying", [True, False])
def test_the_exact_residual_after_the_forward_overlaps_the_same_way(copying):
    """The second pass (an exact Residual sent after the whole Anchor): on a CUDA pool layer l's
    Residual is written once l + 1 is encoded and after it landed, on a CPU pool at once; the
    layers back to back on the stream either way."""
    w, rec = writer(copying=copying)
    for layer in range(LAYERS):
        w.layer(layer)
        rec.layers[-1].landed.set()
    w.finish_anchor()
    rec.log.clear()
    for held in rec.layers:
        held.finished = False
    rec.layers.clear()
    done = threading.Event()

    def land_all() -> None:  # the copy engine: each layer's copies land a little after its start
        while not done.is_set():
            for held in list(rec.layers):
                held.landed.set()
            done.wait(0.01)

    threading.Thread(target=land_all, daemon=True).start()
    try:
        posted = w.finish_residual()
    finally:
        done.set()
    writes_r = [(layer, at) for what, layer, *at in rec.log if what == "rwrite"]
    assert [layer for layer, _ in writes_r] == list(range(LAYERS))
    assert [at[0] for _, at in writes_r] == [100 * i for i in range(LAYERS)]
    assert posted == w.plan.anchor_bytes + 100 * LAYERS
    for layer in range(LAYERS):
        assert rec.log.index(("landed", layer)) < rec.log.index(("rwrite", layer, 100 * layer))
        if copying and layer + 1 < LAYERS:
            assert rec.log.index(("start", layer + 1)) < rec.log.index(("rwrite", layer,
                                                                          100 * layer))
        if not copying and layer + 1 < LAYERS:
            assert rec.log.index(("rwrite", layer, 100 * layer)) < rec.log.index(
                ("start", layer + 1))


def landing(rec: Recorder) -> threading.Event:
    """The copy engine: each started layer's copies land a little after its start, until the
    returned event is set."""
    done = threading.Event()

    def land_all() -> None:
        while not done.is_set():
            for held in list(rec.layers):
                held.landed.set()
            done.wait(0.01)

    threading.Thread(target=land_all, daemon=True).start()
    return done


def segment_writer(copying: bool, fail_at: int | None = None) -> tuple[WindowedWriter, Recorder]:
    w, rec = writer(copying, fail_at=fail_at)
    return WindowedWriter(rec, rec, w.job, None, w.plan, None, None), rec


@pytest.mark.parametrize("copying", [True, False])
def test_a_windowed_segment_overlaps_the_same_way(copying):
    """A segment of a windowed room: on a CUDA pool layer l's copies are waited for once l + 1 is
    encoded, on a CPU pool at once; the Anchor goes out once every layer is in, then each
    layer's Residual from its bound-sized place, back to back on the stream."""
    w, rec = segment_writer(copying)
    done = landing(rec)
    try:
        posted = w._segment(7, w.plan, range(LAYERS), StagingRange(0, w.plan.staging_bytes),
                            last=True)
    finally:
        done.set()
    assert posted == w.plan.anchor_bytes + 100 * LAYERS
    written = [entry for entry in rec.log if entry[0] in ("write", "rwrite", "finish")]
    assert written == [("write", 0), ("finish", "ANCHOR"),
                       *[("rwrite", layer, 100 * layer) for layer in range(LAYERS)],
                       ("finish", "RESIDUAL")]
    for layer in range(LAYERS - 1):
        if copying:
            assert rec.log.index(("start", layer + 1)) < rec.log.index(("landed", layer))
        else:
            assert rec.log.index(("landed", layer)) < rec.log.index(("start", layer + 1))
    assert rec.log.index(("landed", LAYERS - 1)) < rec.log.index(("write", 0))


def test_a_failed_windowed_segment_waits_for_the_copies_in_flight():
    w, rec = segment_writer(copying=True, fail_at=2)
    threading.Timer(0.2, lambda: [held.landed.set() for held in rec.layers]).start()
    with pytest.raises(RuntimeError, match="encode of layer 2 failed"):
        w._segment(7, w.plan, range(LAYERS), StagingRange(0, w.plan.staging_bytes), last=True)
    assert rec.layers[1].finished, "the segment failed with layer 1's copies still running"
    assert not [entry for entry in rec.log if entry[0] in ("write", "rwrite")]

