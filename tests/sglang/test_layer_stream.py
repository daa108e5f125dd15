"""The layer gate of layer streaming (`backend.prefill.layer_stream.LayerGate`): what a destination worker
waiting for layer l of a prefill forward sees. The hooks that drive it run in the PD end-to-end
tests (tests/sglang/test_pd_lynx.py) and the manager-level tests in test_conn_layer_stream.py."""

from __future__ import annotations

import threading
import time

import pytest

from lynx_sglang.backend.prefill.layer_stream import LayerGate, LayerGateError


def _waiter(gate: LayerGate, layer: int, out: list) -> threading.Thread:
    def run():
        try:
            gate.wait(layer, timeout_s=10)
            out.append("open")
        except Exception as exc:  # the test reads what the waiter got
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_layer_opens_when_it_is_written_and_not_before():
    gate = LayerGate(4)
    out: list = []
    t = _waiter(gate, 2, out)
    gate.written(0)
    gate.written(1)
    time.sleep(0.1)
    assert out == []
    gate.written(2)
    t.join(5)
    assert out == ["open"]
    gate.wait(0, timeout_s=0)  # earlier layers stay open


def test_finish_opens_every_layer():
    gate = LayerGate(3)
    gate.finish()
    gate.wait(2, timeout_s=0)


def test_a_failed_forward_wakes_the_waiter_with_the_reason():
    gate = LayerGate(4)
    gate.written(0)
    out: list = []
    t = _waiter(gate, 1, out)
    gate.fail("RuntimeError: boom")
    t.join(5)
    assert isinstance(out[0], LayerGateError)
    assert "before layer 1" in str(out[0]) and "boom" in str(out[0])
    gate.wait(0, timeout_s=0)  # what was written before the failure stays readable


def test_a_wait_has_a_deadline():
    with pytest.raises(TimeoutError, match="layer 0"):
        LayerGate(2).wait(0, timeout_s=0.05)
