"""The KV cache geometry of a model (`KVShape`) and the published shapes Lynx reports against.

One `KVShape` serves everyone: the SGLang backend reads it off a live KV pool, the reports and
benchmarks take a preset or a Hugging Face `config.json`, and byte accounting (`bytes_for`) is
defined here once. Presets are the models' published configurations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
                "fp32": torch.float32, "float": torch.float32}


@dataclass(frozen=True)
class KVShape:
    """Per layer, K and V of `[tokens, num_kv_heads, head_dim]` values of `dtype`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    name: str = ""

    @property
    def hd(self) -> int:
        """Values of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim

    def bytes_per_token(self) -> int:
        """K and V of every layer, in `dtype`."""
        return 2 * self.num_layers * self.hd * self.dtype.itemsize

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.bytes_per_token()

    def with_dtype(self, dtype: torch.dtype | str) -> KVShape:
        return replace(self, dtype=parse_dtype(dtype))

    @classmethod
    def from_hf_config(cls, config: dict | str | Path, dtype: torch.dtype | str = torch.bfloat16,
                       name: str = "") -> KVShape:
        """The shape a Hugging Face `config.json` (a dict, the file, or its folder) describes."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = json.loads(path.read_text())
        cfg = config.get("text_config", config)
        try:
            heads = cfg["num_attention_heads"]
            kv_heads = cfg.get("num_key_value_heads") or heads
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            return cls(cfg["num_hidden_layers"], kv_heads, head_dim, parse_dtype(dtype),
                       name or cfg.get("_name_or_path", ""))
        except KeyError as exc:
            raise ValueError(f"model config has no {exc.args[0]!r}: not a decoder with MHA/GQA "
                             "attention Lynx can size") from None


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown KV dtype {dtype!r}; known: {sorted(_DTYPE_NAMES)}") from None


PRESETS: dict[str, KVShape] = {
    shape.name: shape
    for shape in (
        KVShape(30, 3, 64, name="SmolLM2-135M"),
        KVShape(32, 8, 128, name="Llama-3.1-8B"),
    )
}


def preset(name: str) -> KVShape:
    """The preset named `name` (case-insensitive); a ValueError lists the known ones."""
    for key, shape in PRESETS.items():
        if key.lower() == name.lower():
            return shape
    raise ValueError(f"unknown model shape {name!r}; known: {', '.join(PRESETS)}")


def model_shape(model: str | Path, dtype: torch.dtype | str = torch.bfloat16) -> KVShape:
    """A preset by name, or the KV shape of a Hugging Face model folder / config.json; a
    ValueError (OSError for an unreadable config) says which."""
    if Path(model).exists():
        return KVShape.from_hf_config(model, dtype, name=Path(model).name)
    try:
        return preset(str(model)).with_dtype(dtype)
    except ValueError as exc:
        raise ValueError(f"{exc}, or give a Hugging Face model folder / config.json") from None
