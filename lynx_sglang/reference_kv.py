"""Reference mode for tests and studies: a single (non-disaggregated) SGLang server whose prompt
KV goes through the Lynx codec exactly as a Lynx PD decode receives it.

In Lynx PD the prefill computes the prompt's KV and the first output token at full precision;
the decode then holds `decode(encode(prompt KV), "full")` (the INT8 reconstruction for
`--lynx-target int8`) and computes the KV of generated tokens itself. This mode reproduces that on
one server: right after a request's prefill forward (before its result is processed), its prompt
KV slots are replaced by their codec reconstruction. Greedy outputs of such a server are what a
Lynx PD cluster with the same codec settings must produce token for token.

Enabled by the plugin in scheduler processes when `LYNX_SGLANG_REFERENCE_KV=1` and the codec
settings are in `names.CONFIG_ENV` (both set by the caller, e.g. a test's cluster environment);
it applies only to requests that ask for it with the sampling parameter
`custom_params: {"lynx_reference_kv": true}`, so one server gives full-precision and codec
references side by side. Run the server with `--disable-radix-cache`, so no request reuses
another's KV (reconstructed or not) as a prefix.
"""

from __future__ import annotations

import logging
import os

from .config import LynxConfig
from .names import CONFIG_ENV, REFERENCE_ENV

logger = logging.getLogger(__name__)

REQUEST_FLAG = "lynx_reference_kv"


def enabled() -> bool:
    return os.environ.get(REFERENCE_ENV) == "1"


def quantize_prompt_kv_before(scheduler, batch, result):
    """BEFORE hook on Scheduler.process_batch_result: reconstruct finished prompts' KV."""
    import torch

    from lynx_kernels import decode, encode

    from .backend.pool import KVPoolView

    if not batch.forward_mode.is_extend():
        return None
    config = LynxConfig.from_env()
    if config is None:
        raise RuntimeError(f"{REFERENCE_ENV}=1 needs the codec settings in {CONFIG_ENV}")
    spec = config.codec
    pool = KVPoolView.from_sglang_pool(scheduler.token_to_kv_pool_allocator.get_kvcache())
    for req in batch.reqs:
        params = getattr(req.sampling_params, "custom_params", None) or {}
        if not params.get(REQUEST_FLAG):
            continue
        if req is getattr(scheduler, "chunked_req", None) or req.finished():
            continue  # a middle chunk: the prompt is not complete yet
        n = len(req.origin_input_ids)
        slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        for layer in range(pool.shape.num_layers):
            for kind in pool.kinds:  # K and V; an MLA pool's one latent
                buf = pool.layer(layer, kind)
                buf[slots] = decode(encode(buf[slots], spec, kind.value, layer=layer), "full")
        logger.info("lynx reference: %d prompt tokens' KV reconstructed (%s)", n,
                    spec.target.value)
    return None
