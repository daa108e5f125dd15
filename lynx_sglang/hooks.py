"""The SGLang hook adapters of the transfer path and the idle wait: thin functions SGLang's
HookRegistry calls in a scheduler process, each finding the process's `runtime.LynxRuntime` from
the SGLang object it was given and forwarding to one of its components. Where there is none (a
scheduler of another backend, a decode for the prefill's hooks, a pool on neither CPU nor CUDA
for layer streaming), SGLang's own code runs untouched.

Registered by `lynx_sglang.plugin` (each hook is documented in patches/README.md); the speculation
hooks are `speculation.hooks`.
"""

from __future__ import annotations

from . import runtime


def on_idle_around(original, scheduler, *args, **kwargs):
    """`Scheduler.on_idle`: wait for input or a transfer's progress (`idle.IdleWaiter`)."""
    rt = runtime.of_scheduler(scheduler)
    if rt is None:
        return original(scheduler, *args, **kwargs)
    return rt.idle.on_idle(original, scheduler, *args, **kwargs)


def status_updated_after(result, kv_manager, *args, **kwargs):
    """`CommonKVManager.update_status` of another backend (`names.IDLE_WAIT_ENV`): a transfer's
    status changed, wake the idle wait (Lynx's own manager notifies it itself)."""
    rt = runtime.of_manager(kv_manager)
    if rt is not None:
        rt.idle.notify()
    return result


def process_batch_result_around(original, scheduler, *args, **kwargs):
    """`Scheduler.process_batch_result` on a prefill: SGLang's handling of one forward's results,
    where it calls the backend's `send` for each request the forward completed, runs inside
    `PrefillSender.batched`, so the rooms bound for one decode reach its worker as one group and
    every room's Anchor goes out before any room's Residual (without it, the first room's whole
    transfer came before the second room's Anchor). Layer-streamed rooms are grouped already
    (`run_batch_around`); this serves the rooms sent after their forward."""
    rt = runtime.of_scheduler(scheduler)
    if rt is None or rt.sender is None:
        return original(scheduler, *args, **kwargs)
    with rt.sender.batched():
        return original(scheduler, *args, **kwargs)


def run_batch_around(original, scheduler, batch, *args, **kwargs):
    """`Scheduler.run_batch` on a layer-streaming prefill (`backend.prefill.layer_stream.LayerStreamer`)."""
    rt = runtime.of_scheduler(scheduler)
    if rt is None or rt.layer_stream is None:
        return original(scheduler, batch, *args, **kwargs)
    return rt.layer_stream.run_batch(original, scheduler, batch, *args, **kwargs)


def set_kv_buffer_after(result, pool, layer, *args, layer_id_override=None, **kwargs):
    """`MHATokenToKVPool.set_kv_buffer` (or MLA's `set_kv_buffer` / `set_mla_kv_buffer`, the same
    arguments up to the tensors), inside a forward: layer `layer` of the batch is in the
    pool (CUDA: queued on the forward's stream, which is still current here, so the layer's event
    is recorded after the write). Called for every layer of every forward: a few attribute reads
    where nothing streams."""
    rt = runtime.of_kv_pool(pool)
    if rt is not None and rt.layer_stream is not None:
        rt.layer_stream.layer_written(pool, layer, layer_id_override)
    return result
