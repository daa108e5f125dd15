"""`KVPoolView`: borrowed references to the per-layer KV tensors of an SGLang token-to-KV pool,
so the codec can read and write a request's token slots (whatever the page size: the buffers are
indexed by token slot; `backend.pages` turns SGLang's page indices into slots).

Two pools: SGLang's MHA pool (`MHATokenToKVPool`: K and V per layer, the two kinds `KINDS`) and
its MLA pool (`MLATokenToKVPool`, DeepSeek V2/V3: one latent row per token and layer,
kv_lora_rank + qk_rope_head_dim values, no V). The MLA latent is one kind, K (`LATENT_KINDS`),
seen as heads of `latent_head_dim(width)` values so the codec's per-head rotation applies where
the width allows.

Built by `LynxKVManager.attach_kv_pool` (the plugin hands it SGLang's pool right after the manager
is made) on both roles; the prefill sender reads slots, the decode applier writes them. The pool
owns the tensors; the view only indexes them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from lynx_kernels import KVShape, StreamKind

from ..errors import KVStreamError
from ..upstream.sglang_names import is_plain_mla_pool
from .pages import SUPPORTED_PAGE_SIZES

logger = logging.getLogger(__name__)

KINDS = (StreamKind.K, StreamKind.V)
# An MLA layer's one latent buffer, coded as K (grouped per channel over tokens by default: the
# latent is a key, and its rope part has the channel outliers K has).
LATENT_KINDS = (StreamKind.K,)
# The widest head an MLA latent is cut into: the head width the codec is measured on (SmolLM2,
# Llama). DeepSeek V2/V3's 512 + 64 = 576 values are 9 heads of 64.
LATENT_MAX_HEAD_DIM = 64


def latent_head_dim(width: int) -> int:
    """The head width an MLA latent row of `width` values is cut into: the largest power of two
    up to `LATENT_MAX_HEAD_DIM` dividing it (so the rotation, which needs a power of two, runs
    per head), at least 8 (the codec's smallest head)."""
    d = LATENT_MAX_HEAD_DIM
    while d > 8 and width % d:
        d //= 2
    if width % d:
        raise KVStreamError(f"an MLA latent of {width} values per token is not a multiple of 8, "
                            "which the codec needs")
    return d


@dataclass(frozen=True)
class PoolShape(KVShape):
    """A live pool's `KVShape` plus the kinds it holds per layer (K and V, or the MLA latent
    alone), which the stream layout (`backend.plan.StreamPlan`) follows."""

    kinds: tuple[StreamKind, ...] = KINDS

    def bytes_per_token(self) -> int:
        return len(self.kinds) * self.num_layers * self.hd * self.dtype.itemsize


@dataclass
class KVPoolView:
    """Per-layer buffers `[slots, heads, head_dim]` of one pool; slots are token indices. `v` is
    empty for an MLA pool."""

    k: list[torch.Tensor]
    v: list[torch.Tensor] = field(default_factory=list)
    # SGLang's --page-size: the KV indices its PD code hands over are pages of this many slots.
    page_size: int = 1

    @classmethod
    def from_sglang_pool(cls, pool) -> KVPoolView:
        page_size = int(getattr(pool, "page_size", 1))
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise KVStreamError(
                f"Lynx supports --page-size {', '.join(map(str, SUPPORTED_PAGE_SIZES))}; "
                f"got {page_size}"
            )
        if hasattr(pool, "full_kv_pool"):
            raise KVStreamError(
                f"Lynx supports SGLang's MHA and MLA KV pools only; got {type(pool).__name__} "
                "(hybrid SWA/Mamba and other pools are not supported yet)"
            )
        if hasattr(pool, "k_buffer"):
            return cls(list(pool.k_buffer), list(pool.v_buffer), page_size)
        return cls(_latent_views(pool), [], page_size)

    @property
    def kinds(self) -> tuple[StreamKind, ...]:
        return KINDS if self.v else LATENT_KINDS

    @property
    def shape(self) -> PoolShape:
        t = self.k[0]
        return PoolShape(len(self.k), t.shape[1], t.shape[2], t.dtype, kinds=self.kinds)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def heads(self, first: int, count: int) -> KVPoolView:
        """The same pool seen through KV heads `first`..`first + count - 1` only (no copy; rows
        stay `[slots, count, head_dim]` with the whole pool's row stride): what a decode rank of
        a larger attention TP size holds (`backend.heads`)."""
        if self.kinds != KINDS or not (first >= 0 and count > 0
                                       and first + count <= self.k[0].shape[1]):
            raise KVStreamError(f"no KV heads {first}..{first + count - 1} in a pool of "
                                f"{self.k[0].shape[1]} heads ({len(self.kinds)} kinds)")
        return KVPoolView([t[:, first: first + count] for t in self.k],
                          [t[:, first: first + count] for t in self.v], self.page_size)

    def layer(self, layer: int, kind: StreamKind) -> torch.Tensor:
        if kind is StreamKind.K:
            return self.k[layer]
        if not self.v:
            raise KVStreamError("an MLA KV pool holds no V")
        return self.v[layer]

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


def _latent_views(pool) -> list[torch.Tensor]:
    """Per layer, SGLang's MLA buffer `[slots, 1, width]` seen (no copy) as `[slots, width / d,
    d]` with d = `latent_head_dim(width)`. Only the plain latent pool: DeepSeek V3.2's DSA pool
    (an indexer cache beside the latent, fp8-packed rows) and the FP4 pool hold other layouts."""
    # Neither an MHA nor an MLA pool (no buffer of either): refused before importing SGLang's
    # pool module, which a process that never built an SGLang pool may not be able to import.
    if not hasattr(pool, "kv_buffer"):
        raise KVStreamError(f"Lynx supports SGLang's MHA and MLA KV pools only; got "
                            f"{type(pool).__name__}")
    if not is_plain_mla_pool(pool) or getattr(pool, "use_dsa", False):
        raise KVStreamError(
            f"Lynx supports SGLang's MHA and MLA KV pools only; got {type(pool).__name__}"
            + (" with DSA (an indexer cache beside the latent)" if getattr(pool, "use_dsa", False)
               else "")
        )
    if pool.store_dtype != pool.dtype:
        raise KVStreamError(f"Lynx codes an MLA pool of its own dtype; this one stores "
                            f"{pool.dtype} as {pool.store_dtype}")
    width = int(pool.kv_cache_dim)
    d = latent_head_dim(width)
    logger.info("lynx: MLA KV pool: a latent of %d values per token and layer (%d + %d rope), "
                "coded as K in %d heads of %d", width, pool.kv_lora_rank, pool.qk_rope_head_dim,
                width // d, d)
    return [buf.view(buf.shape[0], width // d, d) for buf in pool.kv_buffer]
