"""The optional seeded random-sign Hadamard rotation over head_dim.

`lynx_kernels.codec` rotates K/V rows before quantizing and rotates back after dequantizing, so
attention always sees the original basis. The rotation is orthonormal, `R = diag(signs) @ H / sqrt(d)`,
built from the seed alone, so the prefill and decode sides derive the same matrix from the chunk
header's seed without shipping it.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def _rotation_cpu(head_dim: int, seed: int) -> torch.Tensor:
    hadamard = torch.ones((1, 1), dtype=torch.float64)
    while hadamard.shape[0] < head_dim:
        hadamard = torch.cat(
            [torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0
        )
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.int64) * 2 - 1
    return (signs.to(torch.float64)[:, None] * hadamard / head_dim**0.5).to(torch.float32)


def rotation_matrix(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """fp32 `[head_dim, head_dim]` orthonormal matrix; rows are rotated as `x @ R`."""
    return _rotation_cpu(head_dim, seed).to(device)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _rows_times(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    # One 2-D matmul over all rows: a [tokens, heads, head_dim] operand would otherwise go through
    # the slower batched path (same products, same per-row sums).
    return (x.reshape(-1, x.shape[-1]) @ matrix).view(x.shape)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 `[..., head_dim]` rows into the rotated basis."""
    return _rows_times(x, rotation_matrix(x.shape[-1], seed, x.device))


def unrotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 `[..., head_dim]` rows back from the rotated basis."""
    return _rows_times(x, rotation_matrix(x.shape[-1], seed, x.device).T)
