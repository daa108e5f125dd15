"""`lynx-sglang codec-report` (lynx_tools.codec.report).

Fast tests run the synthetic path on a few hundred tokens: both targets' wire bytes against the
codec's own size accounting, the exact target's bit identity and its ideal (entropy) bound, the
INT8 reconstruction the entropy is measured against, the CLI and the JSON. The real-KV test runs
the embedded SmolLM2-135M on two short prompts (slow; skipped without the model).
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from lynx_kernels import CodecSpec, encode, preset, protected_positions, run_nbytes
from lynx_kernels.codec import exact_parts
from lynx_tools.cli import main as cli_main
from lynx_tools.codec import measure as codec_measure
from lynx_tools.codec import report as codec_report
from lynx_tools.codec.sample_kv import sample_kv
from lynx_tools.codec.schema import Report, TargetReport

SMOL = preset("SmolLM2-135M")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    codec_report.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def synthetic():
    return codec_report.build_report(_args("--kv", "synthetic", "--tokens", "256",
                                           "--sample-layers", "1"))


def _target(report: Report, name: str) -> TargetReport:
    return next(t for t in report.targets if t.target == name)


def test_defaults_are_the_codec_defaults():
    args = _args()
    spec = CodecSpec()
    assert (args.anchor_bits, args.group_size, args.k_grouping, args.sink_tokens,
            args.recent_tokens, args.rotate) == (spec.anchor_bits, spec.group_size,
                                                 spec.k_grouping.value, spec.sink_tokens,
                                                 spec.recent_tokens, spec.rotate)
    assert args.targets == ["int8", "exact"] and args.chunk_tokens == 256 and args.kv is None


def test_synthetic_report_says_so_and_covers_both_targets(synthetic):
    assert synthetic.kv == "synthetic"
    assert synthetic.kv_description.startswith("synthetic: SmolLM2-135M-shaped")
    assert [t.target for t in synthetic.targets] == ["int8", "exact"]
    assert synthetic.reference_bytes_per_token["bf16"] == SMOL.bytes_per_token()
    for t in synthetic.targets:
        assert t.spec == codec_measure._spec_dict(CodecSpec(target=t.target))


def test_int8_bytes_match_the_codec_sizes(synthetic):
    # The int8 streams have data-independent sizes: exactly run_nbytes' (headers included).
    sizes = run_nbytes(CodecSpec(target="int8"), "k", torch.bfloat16, SMOL.num_kv_heads,
                       SMOL.head_dim, 256, 256)
    t = _target(synthetic, "int8")
    for kind in ("k", "v"):
        assert t.bytes_per_token[kind].anchor == pytest.approx(sizes.anchor * SMOL.num_layers / 256)
        assert t.bytes_per_token[kind].residual == pytest.approx(
            sizes.residual_bound * SMOL.num_layers / 256)
        assert t.bytes_per_token[kind].ideal is None
    both = t.bytes_per_token["k+v"]
    assert both.total == pytest.approx(both.anchor + both.residual)
    assert t.ratio_to_bf16["k+v"].total == pytest.approx(both.total / SMOL.bytes_per_token())
    assert t.bit_identical is None and t.entropy_bits_per_value is None
    assert 0 < t.full_error.relative_rmse < t.anchor_error.relative_rmse < 0.2


def test_exact_is_bit_identical_below_bf16_and_above_its_ideal(synthetic):
    t = _target(synthetic, "exact")
    int8 = _target(synthetic, "int8")
    assert t.bit_identical is True
    assert t.full_error.relative_rmse == 0 and t.full_error.max_abs_error == 0
    assert t.full_error.snr_db is None and t.full_error.cosine_similarity == 1.0
    for kind in ("k", "v", "k+v"):
        b, r = t.bytes_per_token[kind], t.ratio_to_bf16[kind]
        assert b.anchor == int8.bytes_per_token[kind].anchor  # the same Anchor bytes
        assert b.anchor < b.ideal <= b.total
        assert r.ideal <= r.total < 1.0
        assert int8.ratio_to_bf16[kind].total < r.total
        # the ClassRice coder spends more than the entropy, but not much more
        h, spent = t.entropy_bits_per_value[kind], t.correction_bits_per_value[kind]
        assert 0 < h < spent < h + 1.5
    assert t.anchor_error == int8.anchor_error


@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("spec", [CodecSpec(), CodecSpec(rotate=False, sink_tokens=0),
                                  CodecSpec(k_grouping="token", recent_tokens=3)],
                         ids=["default", "plain", "k-per-token"])
def test_int8_reconstruction_is_the_exact_residuals_prediction(spec, kind):
    gen = torch.Generator().manual_seed(3)
    x = sample_kv(200, 3, 64, kind, gen)
    _, prediction = exact_parts(encode(x, spec, kind, layer=1, impl="torch"), impl="torch")
    ours = codec_measure.int8_reconstruction(x, spec, kind, 1)
    keep = torch.ones(len(x), dtype=torch.bool)
    keep[protected_positions(len(x), spec.sink_tokens, spec.recent_tokens, 0, len(x))] = False
    assert torch.equal(ours[keep].view(torch.int16), prediction[keep].view(torch.int16))


def test_conditional_entropy():
    from lynx_kernels.exact import NUM_CLASSES

    span = 2 * 2**16
    hist = torch.zeros(NUM_CLASSES * span, dtype=torch.int64)
    hist[0 * span + 5] = 4  # class 0: four equally likely values -> 2 bits each
    hist[0 * span + 6] = 4
    hist[0 * span + 7] = 4
    hist[0 * span + 8] = 4
    hist[3 * span + 9] = 10  # class 3: one value -> 0 bits
    assert codec_measure._conditional_entropy_bits(hist) == pytest.approx(16 * 2)


def test_real_kv_needs_the_embedded_models_shape():
    with pytest.raises(SystemExit, match="--kv real needs --model SmolLM2-135M"):
        codec_report.build_report(_args("--model", "Llama-3.1-8B", "--kv", "real"))


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli_main(["codec-report", "--model", "Llama-3.1-8B", "--tokens", "128",
                     "--sample-layers", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "KV: synthetic: Llama-3.1-8B-shaped" in text
    assert "target int8" in text and "target exact" in text and "ideal" in text
    assert "bit-identical to the KV: yes" in text
    data = json.loads(out.read_text())  # strict JSON: no NaN/Infinity
    assert data["model"] == "Llama-3.1-8B" and data["kv"] == "synthetic"
    exact = next(t for t in data["targets"] if t["target"] == "exact")
    assert exact["ratio_to_bf16"]["k+v"]["ideal"] <= exact["ratio_to_bf16"]["k+v"]["total"] < 1


@pytest.mark.slow
def test_real_kv_of_the_embedded_model(tmp_path):
    from lynx_tools.model import EmbeddedModelError

    try:
        report = codec_report.build_report(_args("--kv", "real", "--prompts", "2",
                                                 "--prompt-tokens", "300"))
    except EmbeddedModelError as e:
        pytest.skip(f"embedded model unavailable: {e}")
    assert report.kv == "real" and report.layers_measured == SMOL.num_layers
    assert report.kv_description.startswith("real: SmolLM2-135M-Instruct KV of 2 prompts")
    assert "post-RoPE" in report.kv_description
    assert len(report.sequence_tokens) == 2
    assert all(abs(n - 300) <= 40 for n in report.sequence_tokens)
    exact, int8 = _target(report, "exact"), _target(report, "int8")
    assert exact.bit_identical is True and exact.full_error.max_abs_error == 0
    r = exact.ratio_to_bf16["k+v"]
    # docs/codec.md: Anchor ~0.30, total ~0.74 of BF16 on real SmolLM2 KV (longer prompts there)
    assert 0.25 < r.anchor < 0.40 and r.ideal <= r.total < 0.85
    assert int8.ratio_to_bf16["k+v"].total < r.total
    assert math.isfinite(int8.full_error.snr_db) and int8.full_error.snr_db > 40


def test_a_full_decode_that_is_not_bit_identical_fails_the_report(monkeypatch):
    real_apply = codec_measure.apply_residual_run

    def off_by_one_bit(anchor, residual, pool, slots, spec, *args, **kwargs):
        real_apply(anchor, residual, pool, slots, spec, *args, **kwargs)
        if spec.target.value == "exact":
            pool.view(torch.int16)[7, 0, 3] ^= 1

    monkeypatch.setattr(codec_measure, "apply_residual_run", off_by_one_bit)
    with pytest.raises(RuntimeError, match="not decode bit-identical"):
        codec_report.build_report(_args("--kv", "synthetic", "--tokens", "128",
                                        "--sample-layers", "1", "--targets", "exact"))


def test_any_hugging_face_config_gives_its_shape(tmp_path):
    from lynx_kernels import model_shape

    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, '
        '"hidden_size": 512}')
    shape = model_shape(str(tmp_path))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (4, 2, 64)
    with pytest.raises(ValueError, match="Hugging Face model folder"):
        model_shape("no-such-model")
    with pytest.raises(SystemExit, match="Hugging Face model folder"):
        codec_report.build_report(_args("--model", "no-such-model"))
