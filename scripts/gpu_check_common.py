"""What scripts/gpu_check.py's checks share: the model shape they run, the sizes per device
(`Settings`: the CUDA machine's, and the CPU rehearsal's small ones), host buffers as the prefill's
staging, a device sync and a count of the host's waits for the device. Imported by
gpu_check.py and gpu_check_streamed.py (this folder is on sys.path when either runs)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from lynx_kernels import preset

SHAPE = preset("Llama-3.1-8B")
SERVING_CHUNK_TOKENS = 256  # the servers' default --lynx-chunk-tokens
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """Sizes per device: the rehearsal's are small because Triton's interpreter takes ~7 ms per
    token of a Llama layer, on a core shared with other work."""

    tokens: int             # throughput and layer_streamed: tokens of one request
    layers: int             # layer_streamed
    hidden: int             # layer_streamed's synthetic forward: model width, MLP width
    intermediate: int
    repeats: int            # throughput: timed runs per call
    stream_repeats: int     # layer_streamed: timed rounds
    bit_tokens: int         # bit_identity: tokens of a run, cut every bit_chunk_tokens
    bit_chunk_tokens: int
    bit_heads: tuple[int, int] = (SHAPE.num_kv_heads, SHAPE.head_dim)  # bit_identity: KV heads
    bit_spec: dict = field(default_factory=dict)  # CodecSpec fields for bit_identity
    # Not test_gpu_check.py: it runs the CPU rehearsal of this very script.
    pytest_args: tuple[str, ...] = ("tests/kernels", "--ignore=tests/kernels/test_gpu_check.py")
    pytest_timeout_s: int = 270  # the device call's last step; ~8 min in all


SETTINGS = {
    "cuda": Settings(tokens=4096, layers=SHAPE.num_layers, hidden=4096, intermediate=14336,
                     repeats=10, stream_repeats=3, bit_tokens=1000, bit_chunk_tokens=256),
    # bit_identity's 24 runs on 2 x 64 heads (the interpreter's time goes with the values); its
    # protected tokens and groups shrunk with the runs, so a 40-token run still has quantized
    # tokens in both chunks (K's groups over tokens must divide bit_chunk_tokens).
    "cpu": Settings(tokens=32, layers=2, hidden=256, intermediate=512, repeats=1, stream_repeats=1,
                    bit_tokens=40, bit_chunk_tokens=32, bit_heads=(2, 64),
                    bit_spec={"group_size": 32, "sink_tokens": 2, "recent_tokens": 4},
                    pytest_args=("tests/kernels/test_triton.py", "-k",
                                 "refine_in_place or fused_triton"),
                    pytest_timeout_s=150),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def host_buffer(nbytes: int, device: str) -> np.ndarray:
    """Staging as the prefill's: page-locked for a CUDA pool (`backend.staging.StagingPool`)."""
    if device != "cuda":
        return np.zeros(nbytes, np.uint8)
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def host_syncs(fn: Callable[[], T]) -> tuple[T, dict]:
    """`fn()`'s result, and how often it made the host wait for the device (torch's sync debug
    mode: `.item()`, `.tolist()`, a boolean mask, a synchronous copy) with the first few
    warnings: each such wait stalls the thread that queues the next layer's work."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    return result, {"count": len(waits), "first": waits[:5]}
