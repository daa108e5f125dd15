"""`KVPoolView`: borrowed references to the per-layer K/V tensors of an SGLang MHA token-to-KV
pool (page size 1), so the codec can read and write a request's token slots.

Built by `LynxKVManager.attach_kv_pool` (the plugin hands it SGLang's pool right after the manager
is made) on both roles; the prefill sender reads slots, the decode applier writes them. The pool
owns the tensors; the view only indexes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynx_kernels import KVShape, StreamKind

from ..errors import KVStreamError

KINDS = (StreamKind.K, StreamKind.V)


@dataclass
class KVPoolView:
    """Per-layer buffers `[slots, kv_heads, head_dim]` of one pool; slots are token indices."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def from_sglang_pool(cls, pool) -> KVPoolView:
        if hasattr(pool, "full_kv_pool") or not hasattr(pool, "k_buffer"):
            raise KVStreamError(
                f"Lynx supports SGLang's MHA KV pool only; got {type(pool).__name__} "
                "(MLA, hybrid SWA/Mamba and other pools are not supported yet)"
            )
        if getattr(pool, "page_size", 1) != 1:
            raise KVStreamError(
                f"Lynx needs --page-size 1 (token-granular KV slots); got {pool.page_size}"
            )
        return cls(list(pool.k_buffer), list(pool.v_buffer))

    @property
    def shape(self) -> KVShape:
        t = self.k[0]
        return KVShape(len(self.k), t.shape[1], t.shape[2], t.dtype)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def layer(self, layer: int, kind: StreamKind) -> torch.Tensor:
        return (self.k if kind is StreamKind.K else self.v)[layer]

    def read(self, layer: int, kind: StreamKind, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the rows `slots` of one layer's K or V."""
        return self.layer(layer, kind).index_select(0, slots)

    def write(self, layer: int, kind: StreamKind, slots: torch.Tensor,
              values: torch.Tensor) -> None:
        """`layer[slots] = values` along the token dimension."""
        dst = self.layer(layer, kind)
        if dst.device.type == "cpu" and dst.is_contiguous():
            # numpy assigns whole rows; torch's CPU index_copy_ is 2-3x slower here. Bytes, so any
            # dtype (numpy has no bfloat16).
            rows = dst.detach().view(torch.uint8).numpy()
            rows[slots.numpy()] = values.detach().contiguous().view(torch.uint8).numpy()
        else:
            dst.index_copy_(0, slots, values)
