"""`KVPoolView`: borrowed references to the per-layer K/V tensors of an SGLang MHA token-to-KV
pool, so the codec can read and write a request's token slots (whatever the page size: the
buffers are indexed by token slot; `backend.pages` turns SGLang's page indices into slots).

Built by `LynxKVManager.attach_kv_pool` (the plugin hands it SGLang's pool right after the manager
is made) on both roles; the prefill sender reads slots, the decode applier writes them. The pool
owns the tensors; the view only indexes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynx_kernels import KVShape, StreamKind

from ..errors import KVStreamError
from .pages import SUPPORTED_PAGE_SIZES

KINDS = (StreamKind.K, StreamKind.V)


@dataclass
class KVPoolView:
    """Per-layer buffers `[slots, kv_heads, head_dim]` of one pool; slots are token indices."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    # SGLang's --page-size: the KV indices its PD code hands over are pages of this many slots.
    page_size: int = 1

    @classmethod
    def from_sglang_pool(cls, pool) -> KVPoolView:
        if hasattr(pool, "full_kv_pool") or not hasattr(pool, "k_buffer"):
            raise KVStreamError(
                f"Lynx supports SGLang's MHA KV pool only; got {type(pool).__name__} "
                "(MLA, hybrid SWA/Mamba and other pools are not supported yet)"
            )
        page_size = int(getattr(pool, "page_size", 1))
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise KVStreamError(
                f"Lynx supports --page-size {', '.join(map(str, SUPPORTED_PAGE_SIZES))}; "
                f"got {page_size}"
            )
        return cls(list(pool.k_buffer), list(pool.v_buffer), page_size)

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
