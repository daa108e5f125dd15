"""Codec parameters (`CodecSpec`) and the codec's error type.

Both ends of a transfer must agree on every field here: the prefill side writes them into each
chunk header (`lynx_kernels.wire`) and the decode side checks them before placing a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class CodecError(ValueError):
    """Bad input to the codec or a chunk that fails validation; the message says what and where.
    `field` names the CodecSpec field a bad parameter was given for (None otherwise)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class Target(str, Enum):
    """What Anchor + Residual reconstruct.

    INT8: the INT8 codes exactly (the Residual is the low bits of each code).
    EXACT: the original tensor bit for bit (the Residual carries the original values).
    """

    INT8 = "int8"
    EXACT = "exact"


class KGrouping(str, Enum):
    """How K is grouped for its scale/zero: per channel over blocks of tokens (KIVI) or per token."""

    CHANNEL = "channel"
    TOKEN = "token"


class Stage(str, Enum):
    """What a decode reconstructs: the Anchor alone (bucket midpoints) or the full target."""

    ANCHOR = "anchor"
    FULL = "full"


class StreamKind(str, Enum):
    """Which tensor of an attention layer a run of values is (K and V are grouped differently)."""

    K = "k"
    V = "v"


QUANT_BITS = 8
GROUP_SIZES = (32, 64, 128)
MAX_ROTATION_SEED = 2**32 - 1


def _param(default, help_text: str, *, flag: bool = True, choices: tuple | None = None):
    """A CodecSpec field with the help text servers show for it (`lynx_sglang.config` turns every
    field with `flag` into a `--lynx-*` server flag)."""
    meta = {"help": help_text, "flag": flag} | ({"choices": choices} if choices else {})
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class CodecSpec:
    """Parameters of the Anchor/Residual split. `CodecSpec()` is the recommended configuration, the
    one servers use by default (the anchor study in docs/anchor_study/ measured it).

    anchor_bits: top bits of each INT8 code sent in the Anchor (2..6); the Residual carries the
        remaining `8 - anchor_bits` bits (target int8) plus, for target exact (the default), the coded
        correction from the INT8 reconstruction to the original values.
    group_size: values per scale/zero group (32, 64 or 128). For K grouped per channel a group is
        `group_size` consecutive tokens of one channel; otherwise `group_size` consecutive channels
        of one token and head (so head_dim must be divisible by it).
    k_grouping: "channel" (KIVI-style, default) or "token". V is always grouped per token.
    sink_tokens / recent_tokens: the first / last tokens of an encoded run, carried in the Anchor at
        full precision and left out of the group statistics (outliers there would widen the groups).
    rotate: apply a fixed random-sign Hadamard rotation over head_dim before quantizing (undone on
        decode); spreads outlier channels across the group. head_dim must be a power of two.
    rotation_seed: seed of the random signs; both ends must use the same one.
    """

    anchor_bits: int = _param(4, "top bits of each INT8 KV code sent in the high-priority Anchor "
                                 "stream (2..6); the Residual carries the rest")
    group_size: int = _param(64, "values per quantization scale/zero group",
                             choices=GROUP_SIZES)
    target: Target | str = _param(  # noqa: RUF009 (a field() with metadata)
        Target.EXACT, "what Anchor+Residual reconstruct on decode: 'exact' (default) = the "
                      "prefill KV bit for bit (about 0.74 of the BF16 bytes: the INT8 low bits plus "
                      "coded corrections), 'int8' = INT8-KV-equivalent output (about 0.55 of BF16; "
                      "greedy outputs may differ from a single server's)")
    k_grouping: KGrouping | str = _param(  # noqa: RUF009 (a field() with metadata)
        KGrouping.CHANNEL, "K quantization groups: 'channel' (over tokens, KIVI-style) or 'token'; "
                           "V is always grouped per token")
    # Anchor defaults from the anchor study: rotation + 4 sink + 16 recent protected tokens cut the
    # naive Anchor's disagreement with exact decoding from 6.1% to 1.9% on SmolLM2 for +0.01 of
    # BF16 bytes.
    sink_tokens: int = _param(4, "first tokens of each request carried at full precision in the "
                                 "Anchor")
    recent_tokens: int = _param(16, "last tokens of each request carried at full precision in "
                                    "the Anchor")
    rotate: bool = _param(True, "random-sign Hadamard rotation over head_dim before quantizing "
                                "(needs a power-of-two head_dim)")
    rotation_seed: int = _param(0, "seed of the rotation's random signs", flag=False)

    def __post_init__(self) -> None:
        # Accept plain strings from CLIs/configs but store enums, so comparisons are exact.
        try:
            object.__setattr__(self, "target", Target(self.target))
        except ValueError:
            raise CodecError(
                f"target must be one of {[t.value for t in Target]}, got {self.target!r}",
                "target") from None
        try:
            object.__setattr__(self, "k_grouping", KGrouping(self.k_grouping))
        except ValueError:
            raise CodecError(
                f"k_grouping must be one of {[g.value for g in KGrouping]}, got {self.k_grouping!r}",
                "k_grouping") from None
        if not isinstance(self.anchor_bits, int) or not 2 <= self.anchor_bits <= 6:
            raise CodecError(f"anchor_bits must be an integer in 2..6, got {self.anchor_bits!r}",
                             "anchor_bits")
        if self.group_size not in GROUP_SIZES:
            raise CodecError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size!r}",
                             "group_size")
        for name in ("sink_tokens", "recent_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise CodecError(f"{name} must be an integer in 0..65535, got {value!r}", name)
        if not isinstance(self.rotation_seed, int) or not 0 <= self.rotation_seed <= MAX_ROTATION_SEED:
            raise CodecError(f"rotation_seed must be in 0..{MAX_ROTATION_SEED}", "rotation_seed")

    @property
    def residual_bits(self) -> int:
        return QUANT_BITS - self.anchor_bits

    def groups_over_tokens(self, kind: StreamKind | str) -> bool:
        """True when a scale/zero group spans tokens (K per channel), False when it spans channels."""
        return StreamKind(kind) is StreamKind.K and self.k_grouping is KGrouping.CHANNEL
