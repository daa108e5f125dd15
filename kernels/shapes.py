"""KV-cache shapes of the models Lynx reports and benchmarks against.

Used by `lynx-sglang codec-report`, `bench-transfer` and the benchmark scripts to size a model's
KV without loading it. Shapes are the models' published configurations.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bf16_bytes_per_token(self) -> int:
        """K and V of every layer, at 2 bytes a value."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


PRESETS: dict[str, KVShape] = {
    shape.name: shape
    for shape in (
        KVShape("SmolLM2-135M", num_layers=30, num_kv_heads=3, head_dim=64),
        KVShape("Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128),
    )
}


def preset(name: str) -> KVShape:
    """The preset named `name` (case-insensitive); a ValueError lists the known ones."""
    for key, shape in PRESETS.items():
        if key.lower() == name.lower():
            return shape
    raise ValueError(f"unknown model shape {name!r}; known: {', '.join(PRESETS)}")
