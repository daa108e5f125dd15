"""The Anchor quality study's machinery (lynx_tools.study.anchor_study, kv_variants, study_prompts).

The model tests run the real measurement on two short prompts of the embedded model: the identity
variant must reproduce exact decoding (agreement 1, KL ~0, every token accepted), a zeroed KV must
not, and the error ordering bf16 < naive Anchor < zero must hold. The rest checks the baseline
quantizer, the byte ratios and the paired bootstrap without the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lynx_kernels import decode, encode
from lynx_tools.study.anchor_study import PromptResult, VariantResult, measure_prompt, summarize
from lynx_tools.study.kv_variants import (
    NAIVE,
    STUDY_VARIANTS,
    KVVariant,
    VariantKind,
    minmax_quantize,
    variant_by_name,
)

SMOL_KV = (3, 64)  # SmolLM2-135M: kv heads, head_dim


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from lynx_tools.model import EmbeddedModelError
    from lynx_tools.study.anchor_study import load_model

    try:
        return load_model(threads=1)
    except EmbeddedModelError as e:
        pytest.skip(f"embedded model unavailable: {e}")


@pytest.fixture(scope="module")
def measured(model_and_tokenizer):
    from lynx_tools.study.prompts import build_prompts

    model, tok = model_and_tokenizer
    prompts = build_prompts(tok, 2, min_tokens=160, max_tokens=220)
    names = ["identity", "bf16", "naive", "zero"]
    variants = [variant_by_name(n) for n in names]
    # batch 3 puts the variants in two forwards of different sizes: rows must not interact.
    results = [measure_prompt(model, tok, p, variants, n_tokens=6, batch=3) for p in prompts]
    return prompts, variants, results


def test_prompts_are_deterministic_and_sized(model_and_tokenizer):
    from lynx_tools.study.prompts import build_prompts

    _, tok = model_and_tokenizer
    a = build_prompts(tok, 3, min_tokens=200, max_tokens=300)
    b = build_prompts(tok, 3, min_tokens=200, max_tokens=300)
    assert [p.input_ids for p in a] == [p.input_ids for p in b]
    assert [p.family for p in a] == ["passkey", "kv", "continue"]
    for p in a:
        assert 150 <= p.num_tokens <= 350, (p.name, p.num_tokens)
    passkey_text = tok.decode(list(a[0].input_ids))
    assert f"The pass key is {a[0].answer}" in passkey_text
    assert a[1].answer in tok.decode(list(a[1].input_ids))


def test_identity_reproduces_exact_decoding(measured):
    _, _, results = measured
    for r in results:
        ident = r.variants["identity"]
        assert r.positions >= 1
        assert ident.agreement == 1.0
        assert ident.accepted == r.positions
        assert ident.kl_mean < 1e-6
        assert r.greedy_vs_teacher_forced_mismatches == 0


def test_broken_kv_is_detected_and_errors_are_ordered(measured):
    _, _, results = measured
    for r in results:
        v = r.variants
        assert v["bf16"].kl_mean < v["naive"].kl_mean < v["zero"].kl_mean
        assert v["zero"].kl_mean > 0.1
    zero_agree = np.mean([r.variants["zero"].agreement for r in results])
    assert zero_agree < 1.0
    assert sum(r.variants["zero"].accepted for r in results) < sum(r.positions for r in results)


def test_summary_of_real_results(measured):
    _, variants, results = measured
    summary = summarize(results, variants, NAIVE.name, *SMOL_KV, resamples=500)
    by = {s["name"]: s for s in summary["variants"]}
    assert by["naive"]["agreement_diff"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    assert by["identity"]["agreement"]["mean"] == 1.0
    assert by["zero"]["kl_diff"]["lo"] > 0  # every prompt is worse than naive
    assert by["zero"]["kl_lower_than_naive"] == 0


def _fake(values: dict[str, list[float]]) -> list[PromptResult]:
    n = len(next(iter(values.values())))
    return [PromptResult(
        name=f"p{i}", family="continue", depth=None, source=None, num_tokens=100, ids_sha256=str(i),
        positions=10, continuation="", answer=None, exact_contains_answer=None,
        greedy_vs_teacher_forced_mismatches=0, near_ties=0, seconds={},
        variants={k: VariantResult(agreement=v[i], kl_mean=1 - v[i], kl=[1 - v[i]], accepted=5,
                                   positions=10) for k, v in values.items()})
        for i in range(n)]


def test_paired_bootstrap_separates_a_consistent_gain_from_noise():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.85, 0.95, 20)
    better = base + 0.03  # better on every prompt by the same amount
    noise = rng.normal(0, 0.03, 20)
    noisy = base + noise - noise.mean()  # no systematic change
    variants = [NAIVE, variant_by_name("bits5"), variant_by_name("rot")]
    summary = summarize(_fake({"naive": list(base), "bits5": list(better), "rot": list(noisy)}),
                        variants, NAIVE.name, *SMOL_KV, resamples=2000)
    by = {s["name"]: s for s in summary["variants"]}
    assert by["bits5"]["agreement_diff"]["lo"] == pytest.approx(0.03)
    assert by["bits5"]["kl_lower_than_naive"] == 20
    assert by["rot"]["agreement_diff"]["lo"] < 0 < by["rot"]["agreement_diff"]["hi"]
    assert summary["goal_agreement"] == pytest.approx(1 - (1 - base.mean()) / 2)
    # Agreement CI is over prompts and contains the mean.
    a = by["naive"]["agreement"]
    assert a["lo"] < a["mean"] < a["hi"]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("over_tokens", [True, False])
def test_minmax_quantize_is_round_to_nearest_within_groups(bits, over_tokens):
    torch.manual_seed(bits)
    x = torch.randn(100, 3, 64) * torch.linspace(0.1, 4, 64)
    y = minmax_quantize(x, bits, 64, over_tokens)
    flat_x, flat_y = x.reshape(100, -1), y.reshape(100, -1)
    if over_tokens:  # per channel over blocks of 64 tokens (the last block is partial)
        groups = [(flat_x[s:s + 64, c], flat_y[s:s + 64, c]) for s in (0, 64) for c in (0, 5, 191)]
    else:  # per token over 64 channels
        groups = [(flat_x[t, s:s + 64], flat_y[t, s:s + 64]) for t in (0, 99) for s in (0, 64, 128)]
    for gx, gy in groups:
        assert gy.unique().numel() <= 2**bits
        step = (gx.max() - gx.min()) / (2**bits - 1)
        # fp16 scale/zero add a little on top of half a step.
        assert (gx - gy).abs().max() <= step / 2 * 1.01 + 1e-3 * gx.abs().max()
        assert gy.min() <= gx.min() + 1e-6  # the group minimum is a level (zero rounds down)


def test_anchor_variant_is_the_codec_anchor_and_int4_differs():
    torch.manual_seed(0)
    x = torch.randn(128, 3, 64)
    ref = decode(encode(x, NAIVE.spec, "k"), "anchor")
    assert torch.equal(NAIVE.apply(x, "k", 0), ref)
    int4 = variant_by_name("int4-kivi").apply(x, "k", 0)
    # Same bytes, different reconstruction: 16 midpoints of a 256-level grid vs 16 min-max levels.
    assert not torch.allclose(int4, ref)
    assert (int4 - x).abs().max() < (x.max() - x.min()) / 15


def test_byte_ratios():
    ratio = {v.name: v.bytes_ratio(*SMOL_KV, 2048) for v in STUDY_VARIANTS}
    assert ratio["naive"] == pytest.approx(6480 / 23040)  # /work/shared figure: 0.281
    assert ratio["int4-kivi"] == pytest.approx(ratio["naive"])
    assert ratio["int2-kivi"] == pytest.approx(0.15625)
    assert ratio["bf16"] == 1.0
    assert ratio["bits5"] > 0.30 > ratio["rot+sink4+r16"] > ratio["naive"]
    assert ratio["k-g128"] < ratio["naive"]
    with pytest.raises(ValueError):
        KVVariant("bad", VariantKind.ANCHOR)
    with pytest.raises(ValueError):
        variant_by_name("no-such-variant")
