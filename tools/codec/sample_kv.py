"""The codec report's sample KV: the embedded model's real KV over study prompts (`real_kv`) or
generated KV of any model's shape (`synthetic_kv`), as runs of one (sequence, layer, K/V) each.
Used by `lynx_tools.codec.report` and scripts/exact_format_study.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lynx_kernels import KVShape

REAL_MODEL = "SmolLM2-135M"  # the preset whose KV the embedded model produces
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
SYNTHETIC_KV = ("N(0,1) x per-channel log-normal scales, 4% of K channels x8 (outliers), "
                "token 0 x20 (attention sink)")
KINDS = ("k", "v")


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

    from ..model import embedded_model_dir
    from ..study.prompts import build_prompts

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
