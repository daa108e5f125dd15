"""The codec report's measurements: each sample run encoded with the serving call and decoded back
(`TargetSums.add`), summed per target into wire bytes, error statistics and, for the exact target,
the entropy of the corrections (`TargetSums.report`). Used by `lynx_tools.codec.report` and
scripts/exact_format_study.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import numpy as np
import torch

from lynx_kernels import (
    CodecSpec,
    KVShape,
    Target,
    apply_anchor_run,
    apply_residual_run,
    assemble,
    encode_run_into,
    parse_chunk,
    protected_positions,
    run_nbytes,
)
from lynx_kernels import exact as exact_coding
from lynx_kernels.wire import HEADER

from .sample_kv import KINDS
from .schema import ErrorStats, TargetReport, WireBytes


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


class TargetSums:
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
