"""`lynx-sglang codec-report`: what the codec puts on the wire for one model's KV, and how close to
the ideal that is.

For each target (int8 and exact) with one codec spec (by default `CodecSpec()`'s: 4 Anchor bits,
group 64, K per channel, rotation, 4 sink and 16 recent tokens), every (sequence, layer, K/V) run of
the sample KV is encoded with the serving call (`lynx_kernels.fused.encode_run_into`, chunks of
`--chunk-tokens` tokens) and decoded back from those bytes (`apply_anchor_run`,
`apply_residual_run`). Reported:
  - wire bytes per token for the whole model (all layers) of the Anchor, the Residual and both,
    chunk headers included, for K, V and K+V, and as ratios to the BF16 bytes, next to BF16, INT8
    and INT4 KV (codes + fp16 scale/zero per group);
  - for the exact target the ideal: the Anchor + the Residual's low bits (as sent) + the empirical
    entropy H(c | class) of the corrections (c and class as in `lynx_kernels.exact`, against the
    INT8 reconstruction `lynx_kernels.codec.exact_parts` gives, here decoded by the C kernels; one
    histogram per kind over every measured value, so K+V is H(c | kind, class)), i.e. what a
    perfect entropy coder of the corrections under the format's class model would send, and the
    bits per value the ClassRice coder actually spends on them;
  - error statistics of the Anchor and of the full decode over all values; the exact target's full
    decode must be bit-identical to the KV (checked on every run: the report fails otherwise).

Sample KV (`--kv`; the output says which):
  real       the KV of the embedded SmolLM2-135M-Instruct (`lynx_tools.model`, transformers on
             CPU, bf16, no hub access) over `--prompts` study prompts of about `--prompt-tokens`
             tokens (`lynx_tools.study.prompts`), every layer. K is post-RoPE (transformers
             caches it after the rotary embedding), which is what SGLang's KV pool holds too.
             The default for SmolLM2-135M; other shapes have no model here.
  synthetic  `--sample-layers` layers of `--tokens` tokens of Gaussian values with per-channel
             log-normal scales, a few outlier channels in K and a large attention-sink token 0 (what
             makes K hard to quantize in real models), scaled to the model's layer count. The
             default for the other shapes (Llama-3.1-8B).
Writes the report (`Report`, dataclasses) as JSON, default out/codec_report_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from lynx_kernels import (
    PRESETS,
    CodecSpec,
    KGrouping,
    KVShape,
    Target,
    apply_anchor_run,
    apply_residual_run,
    assemble,
    encode_run_into,
    model_shape,
    parse_chunk,
    protected_positions,
    quantized_nbytes_per_token,
    run_nbytes,
)
from lynx_kernels import exact as exact_coding
from lynx_kernels.wire import HEADER

log = logging.getLogger("lynx.codec_report")

REAL_MODEL = "SmolLM2-135M"  # the preset whose KV the embedded model produces
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
SYNTHETIC_KV = ("N(0,1) x per-channel log-normal scales, 4% of K channels x8 (outliers), "
                "token 0 x20 (attention sink)")
KINDS = ("k", "v")
_DEFAULT = CodecSpec()


# ---------------------------------------------------------------------------------------- schema


@dataclass(frozen=True)
class WireBytes:
    """Bytes per token for the whole model (all layers) of one kind (or K+V), or the same as ratios
    to the BF16 bytes. anchor/residual/total: the wire streams, chunk headers included. ideal
    (target exact only): the Anchor + the Residual's low bits + H(c | class) of the corrections."""

    anchor: float
    residual: float
    total: float
    ideal: float | None = None


@dataclass(frozen=True)
class ErrorStats:
    """Reconstruction error of one stage over all sampled values (K and V)."""

    relative_rmse: float  # rms(error) / rms(value)
    snr_db: float | None  # None: no error at all (infinite)
    max_abs_error: float
    cosine_similarity: float  # mean over (token, head) rows


@dataclass(frozen=True)
class TargetReport:
    """One target: `bytes_per_token` and `ratio_to_bf16` keyed "k", "v", "k+v"."""

    target: str
    spec: dict
    bytes_per_token: dict[str, WireBytes]
    ratio_to_bf16: dict[str, WireBytes]
    anchor_error: ErrorStats
    full_error: ErrorStats
    # target exact: bits per coded (non-protected) value the Residual spends beyond its low bits
    # (k tables, record lengths, records; chunk headers excluded), and the entropy H(c | class)
    # of the corrections, keyed "k", "v", "k+v" (K+V: H(c | kind, class); None for int8).
    correction_bits_per_value: dict[str, float] | None = None
    entropy_bits_per_value: dict[str, float] | None = None
    raw_chunks: int = 0  # exact Residual chunks sent as raw values (coded form was longer)
    bit_identical: bool | None = None  # target exact: full decode == the KV bit for bit


@dataclass(frozen=True)
class Report:
    model: str
    layers: int
    kv_heads: int
    head_dim: int
    kv: str  # "real" | "synthetic"
    kv_description: str  # what the sample KV is, as printed
    sequence_tokens: list[int]  # tokens of each sequence (prompt) encoded
    layers_measured: int  # layers of each sequence encoded (bytes are scaled to `layers`)
    chunk_tokens: int
    reference_bytes_per_token: dict[str, float]  # bf16, int8, int4 KV, whole model
    reference_ratio_to_bf16: dict[str, float]
    targets: list[TargetReport] = field(default_factory=list)


# ----------------------------------------------------------------------------------- arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=REAL_MODEL,
                        help=f"KV shape: a preset ({', '.join(PRESETS)}) or any Hugging Face "
                             "model folder / config.json (its KV shape; synthetic KV) "
                             "(default: %(default)s)")
    parser.add_argument("--kv", choices=["real", "synthetic"], default=None,
                        help=f"sample KV: 'real' = the embedded {EMBEDDED_NAME}'s KV over study "
                             f"prompts (only for {REAL_MODEL}), 'synthetic' = generated "
                             f"(default: real for {REAL_MODEL}, synthetic otherwise)")
    parser.add_argument("--prompts", type=int, default=4,
                        help="real KV: number of study prompts (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=1500,
                        help="real KV: about this many tokens per prompt (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="synthetic KV: context length (default: %(default)s)")
    parser.add_argument("--sample-layers", type=int, default=2,
                        help="synthetic KV: layers to generate and encode (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="synthetic KV: seed (default: %(default)s)")
    parser.add_argument("--targets", nargs="+", choices=[t.value for t in Target],
                        default=[Target.INT8.value, Target.EXACT.value],
                        help="what Anchor+Residual reconstruct (default: %(default)s)")
    parser.add_argument("--anchor-bits", type=int, default=_DEFAULT.anchor_bits,
                        help="default: %(default)s")
    parser.add_argument("--group-size", type=int, default=_DEFAULT.group_size,
                        help="default: %(default)s")
    parser.add_argument("--k-grouping", choices=[g.value for g in KGrouping],
                        default=KGrouping(_DEFAULT.k_grouping).value,
                        help="K scale/zero groups (default: %(default)s)")
    parser.add_argument("--sink-tokens", type=int, default=_DEFAULT.sink_tokens,
                        help="default: %(default)s")
    parser.add_argument("--recent-tokens", type=int, default=_DEFAULT.recent_tokens,
                        help="default: %(default)s")
    parser.add_argument("--rotate", action=argparse.BooleanOptionalAction, default=_DEFAULT.rotate,
                        help="Hadamard rotation before quantizing (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=256,
                        help="tokens per wire chunk (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the report here (default: out/codec_report_<model>.json)")


# ----------------------------------------------------------------------------------- sample KV


@dataclass(frozen=True)
class KVSample:
    """Sample KV: `runs()` yields (sequence, layer, kind, [tokens, kv_heads, head_dim] bf16)."""

    kind: str
    description: str
    sequence_tokens: list[int]
    layers: int
    runs: Callable[[], Iterator[tuple[int, int, str, torch.Tensor]]]


def sample_kv(tokens: int, heads: int, head_dim: int, kind: str, gen: torch.Generator):
    """One layer's synthetic K or V (see SYNTHETIC_KV)."""
    channel_scale = torch.exp(0.5 * torch.randn((heads, head_dim), generator=gen))
    if kind == "k":
        outliers = torch.rand((heads, head_dim), generator=gen) < 0.04
        channel_scale = torch.where(outliers, channel_scale * 8, channel_scale)
    x = torch.randn((tokens, heads, head_dim), generator=gen) * channel_scale
    x[0] *= 20
    return x.to(torch.bfloat16)


def synthetic_kv(shape: KVShape, tokens: int, layers: int, seed: int) -> KVSample:
    if tokens < 1 or layers < 1:
        raise SystemExit("--tokens and --sample-layers must be >= 1")

    def runs():
        gen = torch.Generator().manual_seed(seed)
        for layer in range(layers):
            for kind in KINDS:
                yield 0, layer, kind, sample_kv(tokens, shape.num_kv_heads, shape.head_dim, kind, gen)

    description = (f"synthetic: {shape.name}-shaped ({shape.num_kv_heads} KV heads x "
                   f"{shape.head_dim}), {layers} of {shape.num_layers} layers x {tokens} tokens, "
                   f"seed {seed}: {SYNTHETIC_KV}")
    return KVSample("synthetic", description, [tokens], layers, runs)


def real_kv(shape: KVShape, prompts: int, prompt_tokens: int) -> KVSample:
    """The embedded model's KV over study prompts, one prompt's forward at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from .model import embedded_model_dir
    from .study.prompts import build_prompts

    if prompts < 1 or prompt_tokens < 64:
        raise SystemExit("--prompts must be >= 1 and --prompt-tokens >= 64")
    folder = embedded_model_dir()
    embedded = KVShape.from_hf_config(folder)
    if (embedded.num_layers, embedded.hd) != (shape.num_layers, shape.hd):
        raise SystemExit(f"the embedded model's KV ({embedded}) is not {shape.name}'s")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                 local_files_only=True).eval()
    study = build_prompts(tokenizer, prompts, prompt_tokens, prompt_tokens)

    @torch.inference_mode()
    def runs():
        for seq, prompt in enumerate(study):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([prompt.input_ids]), cache=cache, use_cache=True,
                  logits_to_keep=1)
            for layer, cached in enumerate(cache.layers):
                for kind, t in zip(KINDS, (cached.keys, cached.values), strict=True):
                    # [1, kv_heads, tokens, head_dim] -> the pool's [tokens, kv_heads, head_dim]
                    yield seq, layer, kind, t[0].transpose(0, 1).contiguous()
            del cache

    tokens = [p.num_tokens for p in study]
    families = ", ".join(sorted({p.family for p in study}))
    description = (f"real: {EMBEDDED_NAME} KV of {len(study)} prompts ({families}; "
                   f"{min(tokens)}-{max(tokens)} tokens), transformers bf16 forward on CPU, all "
                   f"{shape.num_layers} layers; K post-RoPE, as SGLang's KV pool holds it")
    return KVSample("real", description, tokens, shape.num_layers, runs)


# ---------------------------------------------------------------------------------- measuring


class _ErrorSum:
    """Running sums for ErrorStats (the real KV is too large to concatenate)."""

    def __init__(self) -> None:
        self.sq_err = self.sq = self.max_abs = self.cos = 0.0
        self.rows = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.float(), y.float()
        err = y - x
        self.sq_err += float(err.square().sum(dtype=torch.float64))
        self.sq += float(x.square().sum(dtype=torch.float64))
        self.max_abs = max(self.max_abs, float(err.abs().max()))
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        self.cos += float(cos.sum(dtype=torch.float64))
        self.rows += cos.numel()

    def add_identical(self, x: torch.Tensor) -> None:
        """`add(x, y)` for a y checked bit-identical to x: no error, every row's cosine 1."""
        rows = x.numel() // x.shape[-1]
        self.sq += float(x.float().square().sum(dtype=torch.float64))
        self.cos += rows
        self.rows += rows

    def stats(self) -> ErrorStats:
        return ErrorStats(
            relative_rmse=math.sqrt(self.sq_err / self.sq) if self.sq else 0.0,
            snr_db=None if self.sq_err == 0 else 10 * math.log10(self.sq / self.sq_err),
            max_abs_error=self.max_abs,
            cosine_similarity=self.cos / self.rows if self.rows else 1.0,
        )


def _zero_sums() -> dict[str, float]:
    return dict.fromkeys(KINDS, 0.0)


class _TargetSums:
    """What one target's runs add up to."""

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec
        self.exact = spec.target is Target.EXACT
        self.anchor, self.residual, self.headers = _zero_sums(), _zero_sums(), _zero_sums()
        self.low_bits, self.coded_values, self.token_layers = _zero_sums(), _zero_sums(), _zero_sums()
        self.hist: dict[str, torch.Tensor] = {}
        self.raw_chunks = 0
        self.anchor_error, self.full_error = _ErrorSum(), _ErrorSum()

    def add(self, seq: int, layer: int, kind: str, x: torch.Tensor, chunk_tokens: int) -> None:
        spec = self.spec
        tokens, heads, head_dim = x.shape
        hd = heads * head_dim
        slots = torch.arange(tokens, dtype=torch.int64)
        anchor, residual = _wire(x, slots, spec, kind, layer, seq, chunk_tokens)
        protected = len(protected_positions(tokens, spec.sink_tokens, spec.recent_tokens, 0, tokens))
        self.anchor[kind] += len(anchor)
        self.residual[kind] += len(residual)
        self.headers[kind] += -(-tokens // chunk_tokens) * HEADER.size
        self.low_bits[kind] += tokens * hd * spec.residual_bits / 8
        self.coded_values[kind] += (tokens - protected) * hd
        self.token_layers[kind] += tokens

        pool = torch.empty_like(x)
        apply_anchor_run(anchor, pool, slots, spec, kind, layer, seq, tokens)
        self.anchor_error.add(x, pool)
        apply_residual_run(anchor, residual, pool, slots, spec, kind, layer, seq, tokens)
        if not self.exact:
            self.full_error.add(x, pool)
            return
        if not torch.equal(exact_coding.value_bits(pool), exact_coding.value_bits(x)):
            raise RuntimeError(f"exact target: sequence {seq} layer {layer} {kind.upper()} does "
                               "not decode bit-identical to its KV (a codec bug)")
        self.full_error.add_identical(x)
        self.raw_chunks += sum(c.header.raw for c in map(parse_chunk, _chunk_views(residual)))
        self._add_corrections(seq, layer, kind, x, anchor, chunk_tokens)

    def _add_corrections(self, seq: int, layer: int, kind: str, x: torch.Tensor,
                         anchor: np.ndarray, chunk_tokens: int) -> None:
        """Histogram of (class, correction) of the run's coded (non-protected) values, as
        `lynx_kernels.exact` defines them: c = ord(x) - ord(r), r the INT8 reconstruction
        (`lynx_kernels.codec.exact_parts`; taken here from the C decode of the same run encoded
        for target int8, the same values: `tests/test_codec_report.py` checks it), the class from
        r and the fp16 scales of the run's Anchor."""
        spec = self.spec
        coding = exact_coding.CODINGS[x.dtype]
        if coding.width != 16:
            raise SystemExit("the entropy bound is computed for 16-bit KV only")
        tokens, heads, head_dim = x.shape
        prediction = int8_reconstruction(x, spec, kind, layer, seq, chunk_tokens)
        scale = assemble(_chunk_views(anchor)).scale
        keep = torch.ones(tokens, dtype=torch.bool)
        keep[protected_positions(tokens, spec.sink_tokens, spec.recent_tokens, 0, tokens)] = False
        x_bits = exact_coding.value_bits(x)[keep].reshape(-1)
        r_bits = exact_coding.value_bits(prediction)[keep].reshape(-1)
        e_s = exact_coding.scale_exponents(scale, tokens, heads, head_dim, spec.group_size,
                                           spec.groups_over_tokens(kind), spec.rotate)
        c = exact_coding.ordinal(x_bits, coding) - exact_coding.ordinal(r_bits, coding)
        cls = exact_coding.classes(r_bits, e_s[keep].reshape(-1), coding)
        span = 1 << coding.width  # |c| < span
        hist = torch.bincount(cls * (2 * span) + c + span,
                              minlength=exact_coding.NUM_CLASSES * 2 * span)
        self.hist[kind] = self.hist[kind] + hist if kind in self.hist else hist

    def report(self, shape: KVShape) -> TargetReport:
        layers = shape.num_layers
        per_token = {kind: layers / self.token_layers[kind] for kind in KINDS}
        entropy_bits = {kind: _conditional_entropy_bits(self.hist[kind]) if self.exact else 0.0
                        for kind in KINDS}

        def wire(kinds: tuple[str, ...]) -> WireBytes:
            anchor = sum(self.anchor[k] * per_token[k] for k in kinds)
            residual = sum(self.residual[k] * per_token[k] for k in kinds)
            ideal = None
            if self.exact:
                ideal = anchor + sum((self.low_bits[k] + entropy_bits[k] / 8) * per_token[k]
                                     for k in kinds)
            return WireBytes(anchor, residual, anchor + residual, ideal)

        groups = {"k": ("k",), "v": ("v",), "k+v": KINDS}
        nbytes = {name: wire(kinds) for name, kinds in groups.items()}
        bf16 = {name: len(kinds) * layers * shape.hd * 2 for name, kinds in groups.items()}
        ratios = {name: WireBytes(b.anchor / bf16[name], b.residual / bf16[name], b.total / bf16[name],
                                  None if b.ideal is None else b.ideal / bf16[name])
                  for name, b in nbytes.items()}
        correction = entropy = None
        if self.exact:
            def per_value(bits: dict[str, float]) -> dict[str, float]:
                out = {k: bits[k] / self.coded_values[k] for k in KINDS}
                return out | {"k+v": sum(bits.values()) / sum(self.coded_values.values())}

            correction = per_value({k: 8 * (self.residual[k] - self.headers[k] - self.low_bits[k])
                                    for k in KINDS})
            entropy = per_value(entropy_bits)
        return TargetReport(
            target=self.spec.target.value, spec=_spec_dict(self.spec), bytes_per_token=nbytes,
            ratio_to_bf16=ratios, anchor_error=self.anchor_error.stats(),
            full_error=self.full_error.stats(), correction_bits_per_value=correction,
            entropy_bits_per_value=entropy, raw_chunks=self.raw_chunks,
            bit_identical=True if self.exact else None,  # add() raises on any other outcome
        )


def _conditional_entropy_bits(hist: torch.Tensor) -> float:
    """Total bits of the values counted in `hist` ([class, correction] flattened) under the
    empirical distribution of the correction within each class: N * H(c | class)."""
    counts = hist.view(exact_coding.NUM_CLASSES, -1).double()
    per_class = counts.sum(dim=1, keepdim=True)
    nz = counts > 0
    p = counts / per_class.clamp(min=1)
    return float(-(counts[nz] * torch.log2(p[nz])).sum())


def _wire(x: torch.Tensor, slots: torch.Tensor, spec: CodecSpec, kind: str, layer: int, tag: int,
          chunk_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The run's Anchor and Residual wire bytes, as the serving path writes them."""
    tokens, heads, head_dim = x.shape
    sizes = run_nbytes(spec, kind, x.dtype, heads, head_dim, tokens, chunk_tokens)
    anchor = np.empty(sizes.anchor, dtype=np.uint8)
    residual = np.empty(sizes.residual_bound, dtype=np.uint8)
    a_len, r_len = encode_run_into(x, slots, spec, kind, layer, chunk_tokens, tag, anchor, residual)
    return anchor[:a_len], residual[:r_len]


def int8_reconstruction(x: torch.Tensor, spec: CodecSpec, kind: str, layer: int, tag: int = 0,
                        chunk_tokens: int = 256) -> torch.Tensor:
    """The INT8 reconstruction of `x` under `spec` (any target) that the exact Residual corrects,
    from the wire bytes of a target-int8 run (C kernels; `exact_parts` computes the same with the
    torch reference, several times slower). Protected tokens come back as their original values.
    Raises CodecError for values the int8 target refuses (|rotated value| >= 65504, +-Inf)."""
    int8 = replace(spec, target=Target.INT8)
    slots = torch.arange(len(x), dtype=torch.int64)
    anchor, residual = _wire(x, slots, int8, kind, layer, tag, chunk_tokens)
    out = torch.empty_like(x)
    apply_residual_run(anchor, residual, out, slots, int8, kind, layer, tag, len(x))
    return out


def _chunk_views(data: np.ndarray) -> list[memoryview]:
    """The chunks written back to back in `data` (walks the headers)."""
    view, pos, out = memoryview(data), 0, []
    while pos < len(view):
        end = pos + HEADER.size + HEADER.unpack_from(view, pos)[-2]
        out.append(view[pos:end])
        pos = end
    return out


def _spec_dict(spec: CodecSpec) -> dict:
    return {k: getattr(v, "value", v) for k, v in asdict(spec).items()}


def build_report(args: argparse.Namespace) -> Report:
    try:
        shape = model_shape(args.model)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"--model: {exc}") from None
    kv = args.kv or ("real" if shape.name == REAL_MODEL else "synthetic")
    if kv == "real" and shape.name != REAL_MODEL:
        raise SystemExit(f"--kv real needs --model {REAL_MODEL}: the embedded {EMBEDDED_NAME} is "
                         f"the only model whose KV this tool computes; use --kv synthetic")
    specs = [CodecSpec(anchor_bits=args.anchor_bits, group_size=args.group_size, target=target,
                       k_grouping=args.k_grouping, sink_tokens=args.sink_tokens,
                       recent_tokens=args.recent_tokens, rotate=args.rotate)
             for target in dict.fromkeys(args.targets)]
    sample = (real_kv(shape, args.prompts, args.prompt_tokens) if kv == "real"
              else synthetic_kv(shape, args.tokens, args.sample_layers, args.seed))
    log.info("sample KV: %s", sample.description)
    sums = [_TargetSums(spec) for spec in specs]
    for seq, layer, kind, x in sample.runs():
        for target in sums:
            target.add(seq, layer, kind, x, args.chunk_tokens)
    layers, g = shape.num_layers, args.group_size
    reference = {
        "bf16": float(shape.with_dtype(torch.bfloat16).bytes_per_token()),
        "int8": quantized_nbytes_per_token(8, shape.num_kv_heads, shape.head_dim, g) * layers,
        "int4": quantized_nbytes_per_token(4, shape.num_kv_heads, shape.head_dim, g) * layers,
    }
    return Report(
        model=shape.name, layers=layers, kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        kv=sample.kind, kv_description=sample.description, sequence_tokens=sample.sequence_tokens,
        layers_measured=sample.layers, chunk_tokens=args.chunk_tokens,
        reference_bytes_per_token=reference,
        reference_ratio_to_bf16={k: v / reference["bf16"] for k, v in reference.items()},
        targets=[t.report(shape) for t in sums],
    )


# ----------------------------------------------------------------------------------- printing


def _spec_line(spec: dict) -> str:
    return (f"anchor {spec['anchor_bits']} bits, group {spec['group_size']}, K per "
            f"{spec['k_grouping']}, rotate {'on' if spec['rotate'] else 'off'}, sink "
            f"{spec['sink_tokens']}, recent {spec['recent_tokens']}")


def format_report(report: Report) -> str:
    lines = [f"Lynx codec report — {report.model} ({report.layers} layers, {report.kv_heads} KV "
             f"heads x {report.head_dim}, bf16)",
             f"KV: {report.kv_description}",
             f"wire bytes per token for the whole model, chunks of {report.chunk_tokens} tokens, "
             "headers included",
             "",
             f"{'reference KV':<22}{'bytes/token':>12}{'÷ BF16':>9}"]
    for name, value in report.reference_bytes_per_token.items():
        lines.append(f"{name.upper() + ' KV':<22}{value:>12,.0f}"
                     f"{report.reference_ratio_to_bf16[name]:>9.3f}")
    cols = ("Anchor", "Residual", "total", "ideal")
    for t in report.targets:
        lines += ["", f"target {t.target} ({_spec_line(t.spec)})",
                  f"{'':<6}{'':>2}{' bytes/token ':-^40}{'':>2}{' ÷ BF16 ':-^36}",
                  f"{'':<8}" + "".join(f"{c:>10}" for c in cols) + "  "
                  + "".join(f"{c:>9}" for c in cols)]
        for name, b in t.bytes_per_token.items():
            r = t.ratio_to_bf16[name]
            ideal_b = "—" if b.ideal is None else f"{b.ideal:,.0f}"
            ideal_r = "—" if r.ideal is None else f"{r.ideal:.3f}"
            lines.append(f"  {name.upper():<6}{b.anchor:>10,.0f}{b.residual:>10,.0f}{b.total:>10,.0f}"
                         f"{ideal_b:>10}  {r.anchor:>9.3f}{r.residual:>9.3f}{r.total:>9.3f}"
                         f"{ideal_r:>9}")
        if t.entropy_bits_per_value is not None:
            spent, h = t.correction_bits_per_value, t.entropy_bits_per_value
            lines.append("  corrections, bits per coded value: ClassRice "
                         + ", ".join(f"{k.upper()} {spent[k]:.2f}" for k in spent)
                         + "; entropy H(c | class) "
                         + ", ".join(f"{k.upper()} {h[k]:.2f}" for k in h)
                         + f"; raw chunks {t.raw_chunks}")
        lines.append(f"  {'stage':<8}{'rel. RMSE':>12}{'SNR dB':>10}{'max |err|':>12}{'cosine':>10}")
        for stage, stats in (("anchor", t.anchor_error), ("full", t.full_error)):
            snr = "inf" if stats.snr_db is None else f"{stats.snr_db:.2f}"
            lines.append(f"  {stage:<8}{stats.relative_rmse:>12.5f}{snr:>10}"
                         f"{stats.max_abs_error:>12.5f}{stats.cosine_similarity:>10.6f}")
        if t.bit_identical is not None:
            lines.append("  full decode bit-identical to the KV: "
                         + ("yes (0 error)" if t.bit_identical else "NO"))
    return "\n".join(lines)


def report_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2, allow_nan=False) + "\n"


def run(args: argparse.Namespace) -> int:
    report = build_report(args)
    print(format_report(report))
    path = args.json or Path("out") / f"codec_report_{report.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_json(report))
    log.info("wrote %s", path)
    return 0
