"""The optional seeded random-sign Hadamard rotation over head_dim, in IEEE-exact steps.

`lynx_kernels.codec` rotates K/V rows before quantizing and rotates back after dequantizing, so
attention always sees the original basis. The rotation is orthonormal, `R = diag(signs) @ H / sqrt(d)`
(H the Sylvester Hadamard matrix, rows rotate as `x @ R`), built from the seed alone, so both ends
derive it from the chunk header without shipping it.

It is computed as a fast Walsh-Hadamard transform (FWHT) with a pinned butterfly order, never as a
matmul, so that every implementation (this torch code on CPU or CUDA, the C kernels in
`lynx_kernels.ops_cpu`) rounds identically and the exact Residual's prediction is the same bits
everywhere:

    rotate(x)   = FWHT(x * signs) * fp32(1/sqrt(d))
    unrotate(y) = FWHT(y) * signs * fp32(1/sqrt(d))

FWHT: strides 1, 2, 4, ..., d/2 in that order; at stride h each pair (a, b) = (y[j], y[j + h]) with
j the lower index becomes (a + b, a - b), in fp32. The sign multiplications are exact (signs are
+-1) and commute with rounding, so only the final scale rounds. `inv_sqrt(d)` is
float32(1 / math.sqrt(d)) (0x3E000000 for d=64, 0x3DB504F3 for d=128).
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=64)
def _signs_cpu(head_dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.int64) * 2 - 1
    return signs.to(torch.float32)


def rotation_signs(head_dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 `[head_dim]` of +-1: the diagonal of `diag(signs)` in R. Callers must not modify it."""
    signs = _signs_cpu(head_dim, seed)
    return signs if torch.device(device).type == "cpu" else signs.to(device)


def inv_sqrt(head_dim: int) -> float:
    """fp32(1/sqrt(head_dim)) as a Python float (exactly representable in fp32)."""
    return float(torch.tensor(1.0 / math.sqrt(head_dim), dtype=torch.float32))


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fwht(x: torch.Tensor) -> torch.Tensor:
    """`x @ H` over the last dim (a power of two) of an fp32 tensor, butterfly order as above."""
    d = x.shape[-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return y.view(x.shape)


def _scaled(y: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(inv_sqrt(y.shape[-1]), dtype=torch.float32, device=y.device)
    return y.mul_(scale)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 `[..., head_dim]` rows into the rotated basis (a new tensor)."""
    return _scaled(fwht(x * rotation_signs(x.shape[-1], seed, x.device)))


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 `[..., head_dim]` rows back from the rotated basis (a new tensor)."""
    return _scaled(fwht(y).mul_(rotation_signs(y.shape[-1], seed, y.device)))
