"""The verification forward's attention on SGLang's CPU (torch-native) backend
(`speculation.verify.extend_attention_as_decode`): the same result as SGLang's own extend attention,
without its O((P+n)^2) padded causal pass, and SGLang's code untouched outside a verification (the
hook, `speculation.hooks.extend_attention_around`, asks the controller it finds through the
attention backend's KV pool)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lynx_sglang.idle import IdleWaiter
from lynx_sglang.recorder import Recorder
from lynx_sglang.runtime import LynxRuntime, attach
from lynx_sglang.speculation import hooks, verify


@pytest.fixture(scope="module")
def native_extend(sglang_in_process):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    return TorchNativeAttnBackend._run_sdpa_forward_extend


def _batch(prefixes: list[int], extends: list[int], heads=9, kv_heads=3, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = 4096
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(torch.bfloat16)
    perm = torch.randperm(slots, generator=g)
    req_to_token = torch.zeros(len(prefixes), 2048, dtype=torch.int64)
    at = 0
    for i, (p, n) in enumerate(zip(prefixes, extends, strict=True)):
        req_to_token[i, : p + n] = perm[at: at + p + n]
        at += p + n
    query = torch.randn(sum(extends), heads, dim, generator=g)
    seq = torch.tensor([p + n for p, n in zip(prefixes, extends, strict=True)])
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
                req_pool_indices=torch.arange(len(prefixes)), seq_lens=seq,
                extend_prefix_lens=torch.tensor(prefixes), extend_seq_lens=torch.tensor(extends))


def _run(fn, b, backend=None, **kw):
    out = torch.zeros_like(b["query"])
    fn(backend, b["query"], out, b["k_cache"], b["v_cache"], b["req_to_token"], b["req_pool_indices"],
       b["seq_lens"], b["extend_prefix_lens"], b["extend_seq_lens"], None, scaling=0.125,
       enable_gqa=True, causal=True, is_cross_attn=False, sliding_window_size=None, **kw)
    return out


def test_same_attention_as_sglangs_extend(native_extend):
    b = _batch([700, 5, 1300], [33, 1, 7])
    reference = _run(native_extend, b)
    ours = _run(lambda *a, **k: verify.extend_attention_as_decode(native_extend, *a, **k), b)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_each_position_sees_what_its_decode_step_saw(native_extend):
    """Position j of n attends to keys [0, p + j]: the same as one query at that position."""
    b = _batch([300], [4])
    ours = _run(lambda *a, **k: verify.extend_attention_as_decode(native_extend, *a, **k), b)
    slots = b["req_to_token"][0, :304]
    keys = b["k_cache"][slots].float().movedim(0, 1)
    values = b["v_cache"][slots].float().movedim(0, 1)
    for j in range(4):
        q = b["query"][j].unsqueeze(1)  # [heads, 1, dim]
        one = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), keys[:, : 301 + j].unsqueeze(0), values[:, : 301 + j].unsqueeze(0),
            enable_gqa=True, scale=0.125).squeeze(0).movedim(1, 0)[0]
        torch.testing.assert_close(ours[j], one, rtol=1e-5, atol=1e-5)


def _backend(verifying: bool | None):
    """SGLang's attention backend, built as its model runner builds it, over a KV pool that
    carries a runtime whose controller is or is not verifying (None: no runtime)."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    pool = SimpleNamespace()
    if verifying is not None:
        recorder = Recorder.for_process()
        attach(pool, LynxRuntime(idle=IdleWaiter(recorder.metrics), recorder=recorder,
                                 spec=SimpleNamespace(verifying=verifying)))
    return TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=None,
                                                  token_to_kv_pool=pool))


@pytest.mark.parametrize("verifying", [False, None])
def test_outside_a_verification_sglang_runs_its_own_code(native_extend, verifying):
    calls = []
    b = _batch([10], [2])
    _run(lambda *a, **k: hooks.extend_attention_around(
        lambda *aa, **kk: calls.append(1), *a, **k), b, backend=_backend(verifying))
    assert calls == [1]


def test_during_a_verification_the_hook_attends_as_decode(native_extend):
    b = _batch([40], [3])
    reference = _run(native_extend, b)
    calls = []
    ours = _run(lambda *a, **k: hooks.extend_attention_around(
        lambda *aa, **kk: calls.append(1), *a, **k), b, backend=_backend(True))
    assert calls == []
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
