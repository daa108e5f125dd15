"""An MLA request (DeepSeek V2/V3's KV: one latent row of kv_lora_rank + qk_rope_head_dim values
per token and layer, no V) through Lynx's prefill and decode KV managers with SGLang's own
machinery in one process (conn_pair.py), on SGLang's real `MLATokenToKVPool` on both sides: the
latent arrives bit-identical (target exact), as the INT8 reconstruction (target int8), or as the
Anchor's reconstruction alone (`--no-lynx-residual`), only the request's slots are written, and
both staging ranges are given back; speculating, Success comes at Anchor time and the exact
latent follows; a room larger than the decode's staging arrives exact in segments
(`backend.window`). Also what stays refused: the MLA pools Lynx does not code
(fp8-stored latents). MLA at TP > 1 runs end to end in test_pd_lynx_mla.py.

The managers are built as SGLang's scheduler builds them for an MLA model
(`is_mla_backend=True`, TP 1).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conn_pair import (
    LAYERS,
    LONG_HOLD_S,
    POOL_TOKENS,
    make_cfg,
    open_request,
    poll_until_done,
    prefill_staging_free,
    wait_for,
)

from lynx_kernels import decode as decode_kv
from lynx_kernels import encode
from lynx_sglang.backend.decode.outcome import ResidualState
from lynx_sglang.backend.plan import StreamPlan
from lynx_sglang.backend.pool import LATENT_KINDS, KVPoolView, latent_head_dim
from lynx_sglang.errors import KVStreamError

pytestmark = pytest.mark.sglang

# DeepSeek V2/V3's latent: 512 + 64 = 576 values per token, coded as 9 heads of 64.
KV_LORA_RANK, ROPE_DIM = 512, 64


def mla_pool(sgl, dtype=torch.bfloat16):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(size=POOL_TOKENS, page_size=1, dtype=dtype, kv_lora_rank=KV_LORA_RANK,
                            qk_rope_head_dim=ROPE_DIM, layer_num=LAYERS, device="cpu",
                            enable_memory_saver=False)


def _forward(pd, req, g: torch.Generator) -> None:
    """What a DeepSeek forward writes: a latent row per token and layer (the rope part with a
    few large channels, as RoPE'd keys have), then SGLang's send."""
    for layer, buf in enumerate(pd.prefill.pool.kv_buffer):
        x = torch.randn(len(req.prefill_slots), 1, KV_LORA_RANK + ROPE_DIM, generator=g)
        x[..., KV_LORA_RANK:] *= 4 * (layer + 1)
        x[..., KV_LORA_RANK + 3] *= 20
        buf[req.prefill_slots] = x.to(buf.dtype)
    req.sender.send(req.prefill_slots.to(torch.int32).numpy(), None,
                    num_kv_tokens=len(req.prefill_slots))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _exact(pd, req) -> bool:
    return all(torch.equal(_bits(pd.decode.pool.kv_buffer[layer][req.decode_slots]),
                           _bits(pd.prefill.pool.kv_buffer[layer][req.prefill_slots]))
               for layer in range(LAYERS))


@pytest.mark.parametrize("target,residual", [("exact", True), ("int8", True), ("int8", False)],
                         ids=["exact", "int8", "anchor-only"])
def test_one_mla_request(sgl, make_pd, target, residual):
    cfg = make_cfg(target=target, residual=residual)
    pd = make_pd(cfg, make_pool=mla_pool, kv_head_num=1, mla=True)
    view = pd.prefill.mgr.pool
    assert view.kinds == LATENT_KINDS and not pd.prefill.mgr.pool.v
    assert (view.shape.num_kv_heads, view.shape.head_dim) == (9, 64)
    before = [t.clone() for t in pd.decode.pool.kv_buffer]
    req, g = open_request(sgl, pd, room=3001, seed=3)
    _forward(pd, req, g)

    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    plan = StreamPlan.build(cfg.codec, view.shape, len(req.prefill_slots), cfg.chunk_tokens)
    assert plan.kinds == LATENT_KINDS and len(plan.anchor_run_bytes) == 1
    sent = req.sender.get_transfer_metric().transfer_total_bytes
    if not residual:
        assert sent == plan.anchor_bytes
    elif target == "int8":
        assert sent == plan.anchor_bytes + plan.residual_bytes
    else:
        assert plan.anchor_bytes < sent <= plan.anchor_bytes + plan.residual_bytes
    untouched = torch.ones(POOL_TOKENS + 1, dtype=torch.bool)  # slot 0: SGLang's padding slot
    untouched[req.decode_slots] = False
    spec = cfg.codec
    for layer in range(LAYERS):
        src = pd.prefill.pool.kv_buffer[layer][req.prefill_slots]
        got = pd.decode.pool.kv_buffer[layer][req.decode_slots]
        if target != "exact":
            # The codec on the latent as the manager's view cuts it: 9 heads of 64, K grouping.
            heads = src.view(len(src), 9, 64)
            want = decode_kv(encode(heads, spec, "k", layer=layer),
                             "full" if residual else "anchor")
            assert torch.equal(_bits(got), _bits(want.view_as(got))), layer
            assert not torch.equal(got, src)
        assert torch.equal(pd.decode.pool.kv_buffer[layer][untouched], before[layer][untouched])
    assert target != "exact" or _exact(pd, req)
    wait_for("both staging ranges to be freed", lambda: prefill_staging_free(pd) and (
        pd.decode.mgr.staging.free_bytes() == pd.decode.mgr.staging.nbytes))


def test_a_speculative_mla_room_succeeds_at_anchor_time_then_turns_exact(sgl, make_pd):
    # The Residual is held until the test lets it go (`FaultPlan.release`): no timing margin.
    pd = make_pd(make_cfg(target="exact", speculate=True, spec_policy="always",
                          transfer_timeout_s=LONG_HOLD_S + 30.0),
                 residual_hold_s=LONG_HOLD_S, make_pool=mla_pool, kv_head_num=1, mla=True)
    decode = pd.decode.mgr.applier
    req, g = open_request(sgl, pd, room=3101, seed=31)
    _forward(pd, req, g)
    assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    spec = pd.decode.mgr.lynx.codec
    for layer in range(LAYERS):  # the Anchor's reconstruction, as the view cuts the latent
        src = pd.prefill.pool.kv_buffer[layer][req.prefill_slots]
        want = decode_kv(encode(src.view(len(src), 9, 64), spec, "k", layer=layer), "anchor")
        got = pd.decode.pool.kv_buffer[layer][req.decode_slots]
        assert torch.equal(_bits(got), _bits(want.view_as(got))), layer
    assert decode.residual_outcome(req.room).state is ResidualState.PENDING
    req.receiver.clear()  # SGLang commits the request to its running batch
    pd.prefill.mgr.sender.faults.release()
    outcome = wait_for("the Residual's outcome", lambda: (
        o if (o := decode.residual_outcome(req.room)).state is not ResidualState.PENDING
        else None))
    assert outcome.state is ResidualState.APPLIED
    assert _exact(pd, req)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success


# Exact-target staging for 2 latent layers of this many tokens exceeds 1 MiB; one layer fits.
WINDOWED_TOKENS = 500


def test_an_mla_room_larger_than_decode_staging_arrives_exact_in_segments(sgl, make_pd, caplog):
    cfg = make_cfg(target="exact", staging_mib=1)
    pd = make_pd(cfg, make_pool=mla_pool, kv_head_num=1, mla=True)
    decode = pd.decode.mgr
    plan = StreamPlan.build(cfg.codec, decode.pool.shape, WINDOWED_TOKENS, cfg.chunk_tokens)
    assert plan.staging_bytes > decode.staging.nbytes
    with caplog.at_level(logging.INFO, logger="lynx_sglang.backend.decode.admission"):
        req, g = open_request(sgl, pd, room=3201, seed=32, tokens=WINDOWED_TOKENS)
        _forward(pd, req, g)
        assert poll_until_done(sgl, req.receiver) == sgl.KVPoll.Success
    assert "sent in 2 segments of 1 layers" in caplog.text
    assert _exact(pd, req)
    assert poll_until_done(sgl, req.sender) == sgl.KVPoll.Success
    wait_for("both staging ranges to be freed", lambda: prefill_staging_free(pd) and (
        decode.staging.free_bytes() == decode.staging.nbytes))


@pytest.mark.parametrize("width,head_dim", [(576, 64), (192, 64), (160, 32), (520, 8)])
def test_a_latent_is_cut_into_power_of_two_heads(width, head_dim):
    """DeepSeek V2/V3 (512 + 64) and the small latents of test models: the widest power-of-two
    head up to 64 that tiles the row, so the rotation runs per head."""
    assert latent_head_dim(width) == head_dim


def test_a_latent_the_codec_cannot_cut_is_refused():
    with pytest.raises(KVStreamError, match="not a multiple of 8"):
        latent_head_dim(516)


def test_mla_pools_lynx_does_not_code_are_refused(sgl):
    """An MLA pool that stores its latent in another dtype (fp8, packed as bytes) is refused by
    the view the manager builds at start-up; --kv-cache-dtype fp8 is refused before that
    (sglang_support)."""
    pool = mla_pool(sgl, dtype=torch.float8_e4m3fn)
    with pytest.raises(KVStreamError, match=r"stores torch\.float8_e4m3fn as torch\.uint8"):
        KVPoolView.from_sglang_pool(pool)


def test_reference_mode_reconstructs_an_mla_prompt(sgl, monkeypatch):
    """`reference_kv` (a single server whose prompt KV goes through the codec, the tests'
    reference for int8 outputs) on SGLang's MLA pool: the flagged prompt's latent rows become
    the INT8 reconstruction, every other row is untouched (it looped over K and V before, and an
    MLA pool has no V)."""
    import json
    from types import SimpleNamespace

    from lynx_sglang import reference_kv
    from lynx_sglang.config import LynxConfig
    from lynx_sglang.names import CONFIG_ENV

    config = LynxConfig.build(target="int8", anchor_bits=4, group_size=64)
    monkeypatch.setenv(CONFIG_ENV, json.dumps(config.flat()))
    pool = mla_pool(sgl)
    g = torch.Generator().manual_seed(5)
    for buf in pool.kv_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    before = [buf.clone() for buf in pool.kv_buffer]
    slots = torch.arange(3, 3 + 40)
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[1, :40] = slots
    req = SimpleNamespace(origin_input_ids=list(range(40)), kv=SimpleNamespace(req_pool_idx=1),
                          sampling_params=SimpleNamespace(
                              custom_params={reference_kv.REQUEST_FLAG: True}),
                          finished=lambda: False)
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), chunked_req=None)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True), reqs=[req])
    reference_kv.quantize_prompt_kv_before(scheduler, batch, None)
    view = KVPoolView.from_sglang_pool(pool)
    for layer, (buf, old) in enumerate(zip(pool.kv_buffer, before, strict=True)):
        (kind,) = view.kinds
        rows = old[slots].view(40, -1, latent_head_dim(KV_LORA_RANK + ROPE_DIM))
        want = decode_kv(encode(rows, config.codec, kind.value, layer=layer), "full")
        assert torch.equal(buf[slots].view_as(want), want.to(buf.dtype)), layer
        others = torch.ones(buf.shape[0], dtype=torch.bool)
        others[slots] = False
        assert torch.equal(buf[others], old[others]), layer
