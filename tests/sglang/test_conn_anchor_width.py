"""`--lynx-anchor-width adaptive` through Lynx's prefill and decode KV managers with SGLang's own
machinery in one process (conn_pair.py): the prefill picks the Anchor's width per request from
its measured link and forward (`backend.prefill.anchor_width`), the decode learns it from the first Anchor
chunk and dequantizes that width's Anchor into the pool, and the Residual makes the KV exact
either way. A first chunk naming a width the decode does not take fails the room, naming the
flags. (A prefill and a decode that disagree on the setting fail at connect:
test_conn_transfer's settings mismatch test.)

The test marked `rdma_vm` runs over tcp on the host and over verbs inside the soft-RoCE guest
(conn_pair's LYNX_RDMA_VM / LYNX_RDMA_DEVICE), where the Anchor's bytes are seen only once its
stream is complete, so the width is read then.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conn_pair import (
    LAYERS,
    LONG_HOLD_S,
    NUM_TOKENS,
    failure_message,
    make_cfg,
    poll_until_done,
    start_request,
    wait_for,
)

from lynx_kernels import CodecSpec, StreamKind, decode, encode, preset
from lynx_kernels.wire import HEADER
from lynx_kernels.wire_write import to_chunks
from lynx_sglang.backend.decode.outcome import ResidualState
from lynx_sglang.backend.decode.room import DecodeRoom
from lynx_sglang.backend.plan import room_plans
from lynx_sglang.backend.prefill.anchor_width import GAIN_SHARE, choose_width
from lynx_sglang.backend.prefill.stream_policy import StreamPolicy
from lynx_sglang.backend.streams import anchor_bits_of
from lynx_sglang.config import LynxConfig
from lynx_sglang.errors import KVStreamError, LynxConfigError
from lynx_transport import Stream


def _anchor_of_width(pd, req, bits: int) -> bool:
    """The decode's slots hold the `bits`-wide Anchor's reconstruction of the prefill's KV."""
    spec = replace(pd.decode.mgr.lynx.codec, anchor_bits=bits)
    for kind, src, dst in (("k", pd.prefill.pool.k_buffer, pd.decode.pool.k_buffer),
                           ("v", pd.prefill.pool.v_buffer, pd.decode.pool.v_buffer)):
        for layer in range(LAYERS):
            want = decode(encode(src[layer][req.prefill_slots], spec, kind, layer=layer),
                          "anchor")
            if not torch.equal(dst[layer][req.decode_slots], want):
                return False
    return True


@pytest.mark.sglang
@pytest.mark.rdma_vm
@pytest.mark.parametrize("link, bits", [("slow", 3), ("not measured", 4)])
def test_the_prefill_picks_the_width_and_the_decode_follows(sgl, make_pd, monkeypatch, link,
                                                            bits):
    if link == "slow":
        # The prefill's measurements (`StreamPolicy`): an Anchor takes ~0.1 s per KB to this
        # decode, a forward 1 s: the narrower Anchor saves far more than GAIN_SHARE of it.
        monkeypatch.setattr(StreamPolicy, "link_s_per_byte", lambda self, decode: 1e-4)
        monkeypatch.setattr(StreamPolicy, "forward_s", lambda self, tokens: 1.0)
    # Speculating, with the Residual held back: the pool holds the Anchor SGLang decodes on.
    pd = make_pd(make_cfg(target="exact", speculate=True, spec_policy="always",
                          anchor_width="adaptive", transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S)
    applier = pd.decode.mgr.applier
    req = start_request(sgl, pd, room=7007, seed=17)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert applier.rooms.get(req.room).plan.anchor_bits == bits
    assert _anchor_of_width(pd, req, bits)
    assert not _anchor_of_width(pd, req, 7 - bits)  # the two widths' Anchors differ

    pd.prefill.mgr.sender.faults.release()
    outcome = wait_for("the Residual outcome", lambda: (
        o if (o := applier.residual_outcome(req.room)).state is not ResidualState.PENDING
        else None))
    assert outcome.state is ResidualState.APPLIED, outcome
    for kind in ("k_buffer", "v_buffer"):
        for layer in range(LAYERS):
            assert torch.equal(getattr(pd.decode.pool, kind)[layer][req.decode_slots],
                               getattr(pd.prefill.pool, kind)[layer][req.prefill_slots])


@pytest.mark.sglang
@pytest.mark.parametrize("width", ["fixed", "adaptive"])
def test_an_anchor_stream_that_ends_short_fails_the_room(sgl, make_pd, monkeypatch, width):
    """A prefill that ends its Anchor stream with a layer missing (here: its last layer's write
    dropped, so the stream's end counts only what was sent) fails the room, naming the length:
    before, the decode took the shorter stream as complete and waited for the missing layer's
    Residual until the stall deadline."""
    from lynx_transport.session import Session

    write_stream = Session.write_stream
    last_layer_at = {}

    def drop_last_anchor_layer(self, request_id, stream, src, src_offset, length,
                               stream_offset=0, **kw):
        if Stream(stream) is Stream.ANCHOR and stream_offset == last_layer_at.get("offset"):
            return None
        return write_stream(self, request_id, stream, src, src_offset, length, stream_offset,
                            **kw)

    monkeypatch.setattr(Session, "write_stream", drop_last_anchor_layer)
    pd = make_pd(make_cfg(target="exact", anchor_width=width))
    config = pd.prefill.mgr.lynx
    plan = room_plans(config, pd.prefill.mgr.pool.shape, NUM_TOKENS)[config.codec.anchor_bits]
    last_layer_at["offset"] = plan.anchor_offset(LAYERS - 1)
    req = start_request(sgl, pd, room=7017, seed=18)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Failed
    assert f"the Anchor stream ended after {plan.anchor_bytes - plan.anchor_layer_bytes} B" \
        in failure_message(sgl, req.receiver)
    assert pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes


# ---- the choice -----------------------------------------------------------------------------

ANCHOR = {3: 700_000, 4: 900_000}


def test_unmeasured_or_fixed_keeps_the_configured_width():
    assert choose_width((4,), ANCHOR, 1.0, 1.0, False).anchor_bits == 4
    assert choose_width((3, 4), ANCHOR, None, 1.0, False).anchor_bits == 4
    assert choose_width((3, 4), ANCHOR, 1e-6, None, True).anchor_bits == 4


def test_after_the_forward_the_whole_saving_counts():
    # 200 kB saved at 1 us/B = 0.2 s: 0.2 of a 1 s forward, 0.02 of a 10 s one.
    assert choose_width((3, 4), ANCHOR, 1e-6, 1.0, False).anchor_bits == 3
    assert choose_width((3, 4), ANCHOR, 1e-6, 10.0, False).anchor_bits == 4


def test_layer_streamed_only_what_outlasts_the_forward_counts():
    # At 1 us/B: the 4-bit Anchor takes 0.9 s, hidden under a 1 s forward: nothing to gain.
    assert choose_width((3, 4), ANCHOR, 1e-6, 1.0, True).anchor_bits == 4
    # At 4 us/B: 3.6 s against 2.8 s; both outlast a 1 s forward by 2.6 and 1.8 s.
    choice = choose_width((3, 4), ANCHOR, 4e-6, 1.0, True)
    assert choice.anchor_bits == 3 and "0.800 s sooner" in choice.why
    # Around the threshold: the wide Anchor outlasts a 1 s forward by GAIN_SHARE of it at `s`
    # (the narrow one is hidden), so just over it picks the narrower and just under does not.
    s = 1e-6 * (1 + GAIN_SHARE) / 0.9
    assert choose_width((3, 4), ANCHOR, s * 1.01, 1.0, True).anchor_bits == 3
    assert choose_width((3, 4), ANCHOR, s * 0.99, 1.0, True).anchor_bits == 4


# ---- untrusted first chunks, and the setting's checks -----------------------------------------

def _room(config: LynxConfig) -> DecodeRoom:
    plans = room_plans(config, preset("SmolLM2-135M"), 300)
    plan = plans[config.codec.anchor_bits]
    return DecodeRoom(1, ("127.0.0.1", 1), torch.arange(300), 0, plan, None, plans=plans)


def test_the_decode_takes_only_the_widths_it_allows():
    room = _room(LynxConfig.build(anchor_width="adaptive"))
    assert not room.width_known
    with pytest.raises(KVStreamError, match=r"5 Anchor bits; this decode takes \[3, 4\]"):
        room.resolve_width(5)
    room.resolve_width(3)
    assert room.width_known and room.plan.anchor_bits == 3
    # Once known, the width is the room's: another is refused.
    with pytest.raises(KVStreamError, match=r"takes \[3\]"):
        room.resolve_width(4)
    assert _room(LynxConfig()).width_known


def test_the_width_is_read_from_an_anchor_chunk_only():
    x = torch.randn(64, 3, 64, dtype=torch.bfloat16)
    enc = encode(x, CodecSpec(anchor_bits=3), StreamKind.K, layer=0)
    assert anchor_bits_of(memoryview(to_chunks(enc, 64)[0])) == 3
    residual = to_chunks(enc, 64, stream="residual")[0]
    with pytest.raises(KVStreamError, match="does not start with a Lynx Anchor chunk"):
        anchor_bits_of(memoryview(residual))
    with pytest.raises(KVStreamError, match="does not start with a Lynx Anchor chunk"):
        anchor_bits_of(memoryview(bytes(HEADER.size)))


def test_the_setting_is_checked():
    with pytest.raises(LynxConfigError, match="--lynx-anchor-bits 3 or more"):
        LynxConfig.build(anchor_width="adaptive", anchor_bits=2)
    with pytest.raises(LynxConfigError, match="use fixed"):
        LynxConfig.build(anchor_width="adaptive", residual=False, speculate=False)
    with pytest.raises(LynxConfigError, match="must be one of"):
        LynxConfig.build(anchor_width="per-request")
    assert LynxConfig.build(anchor_width="adaptive").anchor_widths() == (3, 4)
    assert LynxConfig.build(anchor_bits=5).anchor_widths() == (5,)
