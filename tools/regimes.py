"""What a wire-to-forward ratio R stands for on GPUs: a small table of PD deployments (model, prompt
length, H100s of one prefill instance, prefill -> decode link) with R = the BF16 KV's wire time ÷
the prefill forward, both estimated from FLOPs and bytes at a stated MFU, never measured.

Owner of the table in docs/benchmarks.md ("The deployments behind R"; `markdown_table` writes it,
tests/test_regimes.py keeps the doc equal to it). Caller: `tools.ttft.regime` (`bench-ttft
--regime` names the deployments nearest to each R it runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Dense BF16 peak of one H100 SXM (no sparsity), FLOP/s.
H100_BF16_FLOPS = 989e12
# Assumed model FLOPs utilisation of a prefill forward: long prompts are compute-bound matmuls; a
# guess, not a measurement. R scales with it (at 0.25 an 8B 1.5k-token forward takes ~0.1 s).
PREFILL_MFU = 0.4
BF16_BYTES = 2
TOKENS = (1500, 8000, 32000)
LINKS_GBPS = (1, 5, 10, 25, 50, 100, 200, 400)


@dataclass(frozen=True)
class Model:
    """A decoder's size as far as R needs it; `gpus`: H100s of one prefill instance (tensor
    parallel), enough to hold its BF16 weights and some KV."""

    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    gpus: int

    def kv_bytes(self, tokens: int) -> int:
        """BF16 K and V of every layer: what a full-KV transfer (mooncake) moves."""
        return tokens * self.layers * 2 * self.kv_heads * self.head_dim * BF16_BYTES

    def prefill_flops(self, tokens: int) -> float:
        """2 FLOPs per parameter per token (the matmuls), plus causal attention: QKᵀ and AV,
        each ~T²/2 dot products of q_heads × head_dim per layer."""
        return (2 * self.params * tokens
                + 2 * self.layers * tokens ** 2 * self.q_heads * self.head_dim)


MODELS = (
    Model("Llama-3.1-8B", 8.03e9, 32, 32, 8, 128, gpus=1),
    Model("Qwen2.5-32B", 32.8e9, 64, 40, 8, 128, gpus=2),
    Model("Llama-3.1-70B", 70.6e9, 80, 64, 8, 128, gpus=4),
)


@dataclass(frozen=True)
class Deployment:
    """One prefill instance of `model` on H100s sending a `tokens`-token prompt's KV over
    `link_gbps` (the instance's whole prefill -> decode bandwidth; with tensor parallelism each
    GPU sends its shard over its own NIC, so that is their sum)."""

    model: Model
    tokens: int
    link_gbps: float
    mfu: float = PREFILL_MFU

    @property
    def forward_s(self) -> float:
        return self.model.prefill_flops(self.tokens) / (self.model.gpus * H100_BF16_FLOPS
                                                         * self.mfu)

    @property
    def wire_s(self) -> float:
        return self.model.kv_bytes(self.tokens) * 8 / (self.link_gbps * 1e9)

    @property
    def r(self) -> float:
        return self.wire_s / self.forward_s

    def label(self) -> str:
        return (f"{self.model.name}, {_tokens(self.tokens)} tokens, {self.model.gpus}×H100, "
                f"{self.link_gbps:g} Gbit/s: R ≈ {_r(self.r)} (estimate)")


DEPLOYMENTS = tuple(Deployment(m, t, link) for m in MODELS for t in TOKENS for link in LINKS_GBPS)


def nearest(r: float, k: int = 3) -> list[Deployment]:
    """The `k` deployments whose R is closest to `r` on a log scale (R is a ratio: 2 is as far
    from 1 as 4 is from 2)."""
    if r <= 0:
        raise ValueError(f"R must be positive, got {r}")
    return sorted(DEPLOYMENTS, key=lambda d: abs(math.log(d.r / r)))[:k]


def _tokens(tokens: int) -> str:
    return f"{tokens / 1000:g}k"


def _r(r: float) -> str:
    return f"{r:.2g}" if r < 10 else f"{r:.0f}"


def markdown_table() -> str:
    """The table of docs/benchmarks.md: one row per model and prompt length, R per link."""
    head = ["model (H100s)", "tokens", "BF16 KV", "forward (est.)",
            *[f"{g} Gbit/s" for g in LINKS_GBPS]]
    rows = [head, ["---"] * len(head)]
    for m in MODELS:
        for t in TOKENS:
            ds = [Deployment(m, t, g) for g in LINKS_GBPS]
            rows.append([f"{m.name} ({m.gpus})", _tokens(t), f"{m.kv_bytes(t) / 1e6:,.0f} MB",
                         f"{ds[0].forward_s:.2f} s", *[_r(d.r) for d in ds]])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)
