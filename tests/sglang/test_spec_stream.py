"""The spec stream's event protocol over real ZMQ sockets on loopback (publisher as the decode
scheduler drives it, subscriber as a client uses it). The end-to-end check through SGLang is
test_pd_lynx_spec.py::test_spec_stream_reports_speculation_and_rollbacks."""

from __future__ import annotations

from array import array

import pytest

from lynx_sglang.speculation.stream import (
    SpecStreamClient,
    SpecStreamError,
    SpecStreamPublisher,
    SpecView,
)
from lynx_tools.cluster.spec import free_port


@pytest.fixture()
def pub():
    p = SpecStreamPublisher("127.0.0.1", free_port())
    yield p
    p.close()


def _client(pub: SpecStreamPublisher, *rids: str) -> SpecStreamClient:
    client = SpecStreamClient(pub.address)
    for i, rid in enumerate(rids):
        # PUB/SUB set-up: events published before the subscription reached the PUB are lost.
        client.subscribe(rid, settle_s=0.3 if i == len(rids) - 1 else 0)
    return client


def test_speculation_then_rollback_with_correction(pub):
    with _client(pub, "r1", "other") as client:
        out = [10]  # the prefill's first token
        out += [11, 12]
        pub.speculative("r1", out, 1)
        out += [13, 14]
        pub.speculative("r1", out, 3)
        pub.speculative("other", [5, 6], 1)
        # Verification keeps 11, rejects 12 (corrected to 99) and so rolls back 12, 13, 14.
        final = [10, 11, 99]
        pub.verified("r1", final, 1, speculated=4, accepted=1, corrected=True, finished=False)
        pub.verified("other", [5, 6], 1, speculated=1, accepted=1, corrected=False,
                     finished=True)
        client.poll(timeout_s=5)
        view = client.views["r1"]
        assert view.done and not view.finished
        assert view.tokens == final and view.verified_len == 3
        assert view.rollbacks == [(2, [12, 13, 14])]
        seen = [e["type"] for e in client.events if e["rid"] == "r1"]
        assert seen == ["speculative", "speculative", "verified"]
        assert client.views["other"].tokens == [5, 6]


def test_view_shows_provisional_tokens_before_verification(pub):
    with _client(pub, "r2") as client:
        pub.speculative("r2", [7, 8, 9], 1)
        client.poll(timeout_s=0.5)
        view = client.views["r2"]
        assert view.tokens == [7, 8, 9] and view.verified_len == 1 and not view.done


def test_abort_voids_the_provisional_tokens(pub):
    with _client(pub, "r3") as client:
        # SGLang's Req.output_ids is an array.array, not a list.
        pub.speculative("r3", array("q", [1, 2, 3]), 1)
        pub.aborted("r3", array("q", [1]), "Lynx: the Residual KV of this request did not arrive: x")
        client.poll(timeout_s=5)
        view = client.views["r3"]
        assert view.done and view.tokens == [1] and "did not arrive" in view.abort_reason


def test_request_that_never_speculated_gets_one_verified_event(pub):
    with _client(pub, "r4") as client:
        pub.verified("r4", [4], 1, speculated=0, accepted=0, corrected=False, finished=False)
        client.poll(timeout_s=5)
        view = client.views["r4"]
        assert view.done and view.tokens == [4] and view.rollbacks == []


def test_a_lost_event_is_an_error_not_a_wrong_view():
    view = SpecView("r5")
    view.apply({"type": "speculative", "rid": "r5", "seq": 0, "start": 1, "token_ids": [2],
                "prefix_ids": [1]})
    with pytest.raises(SpecStreamError, match="expected event 1, got 2"):
        view.apply({"type": "verified", "rid": "r5", "seq": 2, "start": 1, "token_ids": [2],
                    "speculated": 1, "accepted": 1, "rolled_back": 0, "corrected": False,
                    "finished": True})
    late = SpecView("r6")
    with pytest.raises(SpecStreamError, match="expected event 0, got 3"):
        late.apply({"type": "speculative", "rid": "r6", "seq": 3, "start": 4, "token_ids": [1]})


def test_bad_port_is_a_clear_error(pub):
    port = int(pub.address.rsplit(":", 1)[1])
    with pytest.raises(SpecStreamError, match="cannot bind"):
        SpecStreamPublisher("127.0.0.1", port)


def test_config_checks_the_spec_stream_port():
    from lynx_sglang.config import LynxConfig, LynxConfigError

    with pytest.raises(LynxConfigError, match="needs --lynx-speculate"):
        LynxConfig(speculate=False, spec_stream_port=5000)
    with pytest.raises(LynxConfigError, match=r"0\.\.65535"):
        LynxConfig(spec_stream_port=70000)
    assert LynxConfig().spec_stream_port == 0  # off unless asked for
