"""KV pages and token slots. With `--page-size P` > 1 SGLang's PD code hands a transfer backend
page indices (`kv_to_page_indices`: each page's first slot // P), at page size 1 token slots;
Lynx's codec reads and writes token slots. Page p holds slots p*P .. p*P+P-1, position i of a
request is slot i % P of its (i // P)-th page, and the last page may be partial.

Used by `backend.manager` (both roles turn SGLang's pages into the request's token slots), the
prefill's check of what the decode allocated (`prefill`, `prefill_worker`) and the speculative
decode's bonus slot and rollback (`speculation.verify`).
"""

from __future__ import annotations

import numpy as np

from ..errors import KVStreamError

# Page sizes served end to end (tests/sglang/test_pd_lynx_paged.py); others are refused at start-up.
SUPPORTED_PAGE_SIZES = (1, 16, 64)


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` positions (the last one possibly partial)."""
    return -(-num_tokens // page_size)


def page_ceil(position: int, page_size: int) -> int:
    """The first page boundary at or after `position`: where a request's slots can be freed
    without freeing a page that still holds one of its kept positions."""
    return num_pages(position, page_size) * page_size


def token_slots(pages, page_size: int, num_tokens: int | None):
    """The token slots of the first `num_tokens` positions held by `pages` (int64): the slots of
    the partial last page past `num_tokens` are not the request's KV and are left out. At page
    size 1 the indices are the slots and are returned as they are."""
    if page_size == 1:
        return pages
    if num_tokens is None:
        raise KVStreamError(f"lynx: KV pages of {page_size} tokens came without the number of "
                            "tokens they hold")
    pages = np.asarray(pages, dtype=np.int64)
    if len(pages) != num_pages(num_tokens, page_size):
        raise KVStreamError(f"{len(pages)} KV pages of {page_size} tokens cannot hold exactly "
                            f"{num_tokens} tokens")
    slots = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).reshape(-1)
    return slots[:num_tokens]
