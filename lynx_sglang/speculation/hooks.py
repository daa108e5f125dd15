"""The SGLang hook adapters of speculation: thin functions SGLang's HookRegistry calls in a decode
scheduler process, each forwarding to the process's `SpecController` once one is bound.

`HOOKS` lists every target with the adapter and the hook kind (`plugin` registers them; each is
documented in patches/README.md). The controller is bound by `bind` when the decode KV manager gets
its pool (`plugin`); before that, and in a prefill scheduler, every adapter is a no-op.
"""

from __future__ import annotations

from .controller import SpecController
from .verify import extend_attention_as_decode

_controller: SpecController | None = None


def bind(controller: SpecController | None) -> None:
    """Make `controller` the one every hook of this process forwards to (None: unbind)."""
    global _controller
    _controller = controller


def controller() -> SpecController | None:
    return _controller


def process_decode_queue_before(scheduler):
    ctl = controller()
    if ctl is not None:
        ctl.step(scheduler)


def is_fully_idle_around(original, scheduler, *args, **kwargs):
    # Parked requests hold KV outside SGLang's queues: the scheduler is not idle (its idle path
    # would report their slots as a leak, or sleep until the next request arrives).
    ctl = controller()
    if ctl is not None and ctl.parked and not kwargs.get("for_health_check", False):
        return False
    return original(scheduler, *args, **kwargs)


def abort_request_after(result, scheduler, recv_req):
    ctl = controller()
    if ctl is not None and ctl.parked:
        ctl.abort_parked(scheduler, recv_req)
    return result


def commit_transfer_after(result, queue, decode_req):
    ctl = controller()
    if ctl is not None and decode_req.req.finished_reason is None:
        ctl.on_commit(decode_req.req)
    return result


def process_batch_result_prebuilt_after(result, processor, batch):
    ctl = controller()
    if ctl is not None:
        ctl.on_prebuilt(batch)
    return result


def sample_before(runner, logits_output, forward_batch):
    """Record the logits each speculative token of a sampled request is drawn from, before the
    sampler turns them into probabilities in place."""
    ctl = controller()
    if ctl is None or not ctl.sampled_by_pool_idx or not forward_batch.forward_mode.is_decode():
        return None
    ctl.record_draft_logits(forward_batch.req_pool_indices.tolist(),
                            logits_output.next_token_logits)
    return None


def update_finish_state_around(original, req, new_accepted_len: int = 1):
    st = getattr(req, "lynx_spec", None)
    if st is None or req.to_finish is not None or len(req.output_ids) <= st.verified_len:
        return original(req, new_accepted_len)
    original(req, new_accepted_len)
    if req.finished_reason is not None:
        # A finish decided on unverified tokens: hold it; verification decides for real.
        req.finished_reason = None
        req.finished_len = None
        st.finish_pending = True
    return None


def accept_around(original, accumulator, *, req):
    st = getattr(req, "lynx_spec", None)
    if st is None or len(req.output_ids) <= st.verified_len:
        return original(accumulator, req=req)
    full = req.output_ids
    req.output_ids = full[: st.verified_len]
    try:
        return original(accumulator, req=req)
    finally:
        req.output_ids = full


def release_kv_cache_before(req, tree_cache, *, checkpoint: bool):
    ctl = controller()
    if ctl is not None:
        ctl.on_release(req)


# (SGLang target, adapter, HookRegistry kind)
HOOKS = (
    ("sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin.process_decode_queue",
     process_decode_queue_before, "BEFORE"),
    ("sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req",
     commit_transfer_after, "AFTER"),
    ("sglang.srt.managers.scheduler_components.batch_result_processor."
     "SchedulerBatchResultProcessor.process_batch_result_prebuilt",
     process_batch_result_prebuilt_after, "AFTER"),
    ("sglang.srt.managers.schedule_batch.Req.update_finish_state",
     update_finish_state_around, "AROUND"),
    ("sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator.accept",
     accept_around, "AROUND"),
    ("sglang.srt.mem_cache.common.release_kv_cache", release_kv_cache_before, "BEFORE"),
    ("sglang.srt.managers.scheduler.Scheduler.is_fully_idle", is_fully_idle_around, "AROUND"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.sample", sample_before, "BEFORE"),
    ("sglang.srt.managers.scheduler.Scheduler.abort_request", abort_request_after, "AFTER"),
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
     "_run_sdpa_forward_extend", extend_attention_as_decode, "AROUND"),
)
