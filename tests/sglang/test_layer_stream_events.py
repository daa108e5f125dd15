"""Layer streaming's CUDA code path (`backend.prefill.layer_stream`: per-layer events) run here without a
GPU: `LayerStreamer` drives its gate with a stand-in event type (`StandInEvent`) that remembers
which thread recorded it on which stream and stays incomplete until the test completes it, as a
CUDA event does until the forward's stream has run the layer's KV write. The destination worker
here is a thread doing what the room writer does (`backend.prefill.writer.RoomWriter.layer`): wait
on the gate, then read the layer. The real writer over a held event is in
test_conn_layer_stream_events.py."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch

from lynx_sglang.backend.prefill.layer_stream import LayerGate, LayerGateError, LayerStreamer
from lynx_sglang.backend.prefill.stream_policy import StreamPolicy

# The stand-in requests carry SGLang 0.5.23's extend fields (`prefix_len`, `extend_end`).
pytestmark = pytest.mark.usefixtures("standin_release")

LAYERS = 4
WAIT_S = 10


class StandInDevice:
    """Each thread's current stream (`stream` sets it, as `torch.cuda.stream` does) and the
    events made for the streamer (`make_event`, its `EventFactory`), in order."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.events: list[StandInEvent] = []

    @contextmanager
    def stream(self, name: str):
        before = self.current_stream()
        self._local.stream = name
        try:
            yield
        finally:
            self._local.stream = before

    def current_stream(self) -> str:
        return getattr(self._local, "stream", "default")

    def make_event(self) -> StandInEvent:
        event = StandInEvent(self)
        self.events.append(event)
        return event


class StandInEvent:
    """`torch.cuda.Event`'s interface: incomplete until `complete` (the stream ran the work)."""

    def __init__(self, device: StandInDevice) -> None:
        self.device = device
        self.recorded: tuple[str, str] | None = None  # (thread, stream)
        self.queried_by: set[str] = set()
        self._done = threading.Event()

    def record(self, stream: str | None = None) -> None:
        self.recorded = (threading.current_thread().name, stream or self.device.current_stream())

    def query(self) -> bool:
        self.queried_by.add(threading.current_thread().name)
        return self._done.is_set()

    def synchronize(self) -> None:
        raise AssertionError("a gate wait blocked on an event with no deadline")

    def complete(self) -> None:
        self._done.set()


class Worker:
    """A destination worker streaming one room: waits on the gate for each layer in order and
    reads it (`reads`: the layers read; `error`: what ended it early)."""

    def __init__(self, gate: LayerGate) -> None:
        self.gate, self.reads, self.error = gate, [], None
        self.thread = threading.Thread(target=self._run, name="worker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for layer in range(self.gate.num_layers):
                self.gate.wait(layer, WAIT_S)
                self.reads.append(layer)
        except Exception as exc:  # the test reads what the worker got
            self.error = exc


class Sender:
    """`PrefillSender.start_early`: each forward's rooms go to one worker (whatever a
    `forward_tokens` policy would say: the events are what is tested here)."""

    def __init__(self) -> None:
        self.workers: list[Worker] = []
        self.stream_policy = StreamPolicy(0)

    def start_early(self, rooms, gate: LayerGate, forward_tokens: int | None = None) -> set[int]:
        self.workers.append(Worker(gate))
        return {room for room, _ in rooms}


def _batch(overlap: bool = False, hicache_consumer_index: int = -1):
    """A scheduler and an extend batch of one request whose whole prompt this forward computes
    (`overlap`: under SGLang's overlap scheduler, whose forward runs on its "forward" stream)."""
    scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(
        req_to_token=torch.arange(16).reshape(2, 8)), enable_overlap=overlap,
        forward_stream="forward")
    req = SimpleNamespace(origin_input_ids=list(range(8)), bootstrap_room=7, extend_end=8,
                          prefix_len=0, kv=SimpleNamespace(req_pool_idx=0))
    return scheduler, SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True),
                                      reqs=[req], hicache_consumer_index=hicache_consumer_index)


def _forward(streamer: LayerStreamer, reported: int, raises: bool = False,
             device: StandInDevice | None = None):
    """SGLang's forward: queues the KV write of layers [0, reported) on its stream, each
    followed by the `set_kv_buffer` hook, then returns (or raises). With `device`, the forward
    makes its stream current itself, as the overlap scheduler's `run_batch` does
    (`forward_stream_ctx`), and the caller's is current again once it returns."""
    pool = SimpleNamespace(start_layer=0)

    def run(scheduler, batch):
        with device.stream(scheduler.forward_stream) if device else nullcontext():
            for layer in range(reported):
                streamer.layer_written(pool, SimpleNamespace(layer_id=layer), None)
            if raises:
                raise RuntimeError("boom")
            return "result"
    return run


def _run_batch_on_scheduler(streamer: LayerStreamer, device: StandInDevice, forward,
                            overlap: bool = False) -> list:
    """`run_batch` on a thread named like the scheduler's, on its forward stream (`overlap`: on
    the scheduler's own stream; the forward switches); returns what it returned or raised once
    it has ended."""
    out: list = []

    def run():
        scheduler, batch = _batch(overlap)
        with device.stream("schedule" if overlap else "forward"):
            try:
                out.append(streamer.run_batch(forward, scheduler, batch))
            except Exception as exc:  # the test reads it
                out.append(exc)

    t = threading.Thread(target=run, name="scheduler", daemon=True)
    t.start()
    t.join(WAIT_S)
    return out


def _wait_for(what: str, cond) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_layer_is_read_only_once_its_event_has_completed():
    """The forward has queued every layer (the gate is open to the last) but its stream has run
    none: the worker reads nothing; each completed event lets exactly its layer be read. The
    layer no hook reported waits for the event `run_batch` recorded after the forward."""
    device, sender = StandInDevice(), Sender()
    streamer = LayerStreamer(sender, LAYERS, device.make_event)
    out = _run_batch_on_scheduler(streamer, device, _forward(streamer, LAYERS - 1))
    assert out == ["result"]
    worker = sender.workers[0]
    assert worker.gate.opened == LAYERS and len(device.events) == LAYERS
    time.sleep(0.2)
    assert worker.reads == [] and worker.error is None
    for layer, event in enumerate(device.events):
        event.complete()
        _wait_for(f"layer {layer} read", lambda n=layer + 1: len(worker.reads) == n)
        time.sleep(0.05)
        assert worker.reads == list(range(layer + 1))
    worker.thread.join(WAIT_S)
    assert worker.error is None
    # Recorded by the scheduler thread on the forward's stream, after each write; waited for by
    # polling on the worker's thread only.
    assert {e.recorded for e in device.events} == {("scheduler", "forward")}
    assert {name for e in device.events for name in e.queried_by} == {"worker"}


def test_under_overlap_every_event_is_recorded_on_the_forward_stream():
    """SGLang's overlap scheduler runs the forward on its forward stream, which is current only
    inside `run_batch`'s forward: the layers' events are recorded there by the hook, and the
    event after the forward (the layer no hook reported) on `scheduler.forward_stream`, not on
    the scheduler's stream current again when the forward returns (an event there would complete
    before the forward's last layer is written). Before, overlap turned layer streaming off."""
    device, sender = StandInDevice(), Sender()
    streamer = LayerStreamer(sender, LAYERS, device.make_event)
    out = _run_batch_on_scheduler(streamer, device, _forward(streamer, LAYERS - 1, device=device),
                                  overlap=True)
    assert out == ["result"]
    assert len(sender.workers) == 1, "overlap: the forward's room was not streamed"
    worker = sender.workers[0]
    assert worker.gate.opened == LAYERS and len(device.events) == LAYERS
    assert {e.recorded for e in device.events} == {("scheduler", "forward")}
    time.sleep(0.1)
    assert worker.reads == []
    for event in device.events:
        event.complete()
    worker.thread.join(WAIT_S)
    assert worker.reads == list(range(LAYERS)) and worker.error is None


def test_a_batch_loading_its_prefix_from_hicache_is_not_streamed():
    """HiCache may still be loading the batch's cached prefix into the pool, and the forward
    waits for a layer's load only after writing the layer: such a batch goes after its forward."""
    sender = Sender()
    streamer = LayerStreamer(sender, LAYERS)
    scheduler, batch = _batch(hicache_consumer_index=0)
    assert streamer.run_batch(_forward(streamer, LAYERS), scheduler, batch) == "result"
    assert sender.workers == []
    scheduler, batch = _batch()
    assert streamer.run_batch(_forward(streamer, LAYERS), scheduler, batch) == "result"
    assert len(sender.workers) == 1


def test_a_forward_that_raises_fails_the_waiters():
    """A failed forward fails the wait for a layer it did not write, with the reason; the layer
    it queued before is still read once its event completes."""
    device, sender = StandInDevice(), Sender()
    streamer = LayerStreamer(sender, LAYERS, device.make_event)
    out = _run_batch_on_scheduler(streamer, device, _forward(streamer, 1, raises=True))
    assert isinstance(out[0], RuntimeError)
    worker = sender.workers[0]
    time.sleep(0.1)
    assert worker.reads == [] and worker.error is None
    device.events[0].complete()
    worker.thread.join(WAIT_S)
    assert worker.reads == [0]
    assert isinstance(worker.error, LayerGateError)
    assert "before layer 1" in str(worker.error) and "boom" in str(worker.error)
    assert len(device.events) == 1  # no event for a forward that did not return


def test_an_incomplete_event_keeps_the_deadline():
    gate = LayerGate(2)
    device = StandInDevice()
    gate.written(0, device.make_event())
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"layer 0 .*not written on the device within 0\.05 s"):
        gate.wait(0, timeout_s=0.05)
    assert time.monotonic() - t0 < 1
    with pytest.raises(TimeoutError, match="layer 1 of the prefill forward not written"):
        gate.wait(1, timeout_s=0.05)


def test_an_unreported_layer_waits_for_the_next_event():
    """A layer opened by a later layer's write (no hook of its own) is on the device once that
    layer's event has completed: the forward's stream runs in order."""
    gate = LayerGate(LAYERS)
    device = StandInDevice()
    first, later = device.make_event(), device.make_event()
    gate.written(0, first)
    gate.written(2, later)
    first.complete()
    gate.wait(0, timeout_s=0)
    with pytest.raises(TimeoutError, match="layer 1 "):
        gate.wait(1, timeout_s=0.05)
    later.complete()
    gate.wait(1, timeout_s=1)
    gate.wait(2, timeout_s=1)


def test_a_cpu_pool_records_no_event():
    """CPU: the same scheduling with no event; each layer is read as soon as it is written."""
    sender = Sender()
    streamer = LayerStreamer(sender, LAYERS)
    out = _run_batch_on_scheduler(streamer, StandInDevice(), _forward(streamer, LAYERS))
    assert out == ["result"]
    worker = sender.workers[0]
    worker.thread.join(WAIT_S)
    assert worker.reads == list(range(LAYERS)) and worker.error is None


def test_for_pool_chooses_the_event_by_device(caplog):
    with caplog.at_level(logging.INFO, logger="lynx_sglang.backend.prefill.layer_stream"):
        cpu = LayerStreamer.for_pool(Sender(), LAYERS, "cpu")
        cuda = LayerStreamer.for_pool(Sender(), LAYERS, "cuda")
        other = LayerStreamer.for_pool(Sender(), LAYERS, "xpu")
    assert cpu is not None and cpu.make_event is None
    assert cuda is not None and cuda.make_event is torch.cuda.Event
    assert other is None
    said = [r.getMessage() for r in caplog.records]
    assert "layer streaming on: each layer's Anchor" in said[0]
    assert "layer streaming on: per-layer CUDA events" in said[1]
    assert "layer streaming off: the KV pool is on xpu" in said[2]
