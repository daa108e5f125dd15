"""The SGLang hook adapters of speculation: thin functions SGLang's HookRegistry calls in a decode
scheduler process, each forwarding to the process's `SpecController` (`runtime.LynxRuntime.spec`).

`HOOKS` lists every target with the adapter and the hook kind (`plugin` registers them; each is
documented in patches/README.md). Each adapter finds the controller from the SGLang object it was
given: the scheduler's KV manager (`runtime.of_scheduler`), or, inside the model and the KV cache,
the KV pool the manager was handed (`runtime.of_kv_pool`). Before the decode KV manager has its
pool, and in a prefill scheduler, there is none and every adapter is a no-op.
"""

from __future__ import annotations

from .. import runtime
from ..upstream import adapter as upstream_adapter
from ..upstream import hook_table
from . import penalties
from .controller import SpecController
from .verify import extend_attention_as_decode


def _spec(rt: runtime.LynxRuntime | None) -> SpecController | None:
    return None if rt is None else rt.spec


def process_decode_queue_before(scheduler):
    ctl = _spec(runtime.of_scheduler(scheduler))
    if ctl is not None:
        ctl.step(scheduler)


def is_fully_idle_around(original, scheduler, *args, **kwargs):
    # Parked requests hold KV outside SGLang's queues: the scheduler is not idle (its idle path
    # would report their slots as a leak, or sleep until the next request arrives).
    ctl = _spec(runtime.of_scheduler(scheduler))
    if ctl is not None and ctl.parked and not kwargs.get("for_health_check", False):
        return False
    return original(scheduler, *args, **kwargs)


def abort_request_after(result, scheduler, recv_req):
    ctl = _spec(runtime.of_scheduler(scheduler))
    if ctl is not None and ctl.parked:
        ctl.abort_parked(scheduler, recv_req)
    return result


def commit_transfer_after(result, queue, decode_req):
    ctl = _spec(runtime.of_scheduler(queue.scheduler))
    if ctl is not None and decode_req.req.finished_reason is None:
        ctl.on_commit(decode_req.req, overlap=bool(getattr(queue.scheduler, "enable_overlap",
                                                           False)))
    return result


def process_batch_result_prebuilt_after(result, processor, batch):
    ctl = _spec(runtime.of_kv_pool(processor.token_to_kv_pool_allocator.get_kvcache()))
    if ctl is not None:
        ctl.on_prebuilt(batch)
    return result


def sample_before(runner, logits_output, forward_batch):
    """Record the logits each speculative token of a sampled request is drawn from, before the
    sampler transforms them in place (penalties and logit bias: `speculation.penalties`; then
    probabilities), and have the sampler filter them as `upstream.sampling_filter` does."""
    ctl = _spec(runtime.of_kv_pool(runner.token_to_kv_pool))
    if ctl is None or not ctl.sampled_by_pool_idx or not forward_batch.forward_mode.is_decode():
        return None
    pool_indices = forward_batch.req_pool_indices.tolist()
    if any(i in ctl.sampled_by_pool_idx for i in pool_indices):
        # Verification filters a draft row as SGLang's full-sort path does; its topk shortcut
        # (a batch whose requests all set top_k) may keep other tokens tied at a cut.
        upstream_adapter.scheduler().disable_topk_shortcut(forward_batch.sampling_info)
    ctl.record_draft_logits(pool_indices, logits_output.next_token_logits,
                            forward_batch.sampling_info)
    return None


def cumulate_penalty_output_tokens_around(original, batch):
    # Stateless (a one-shot attribute `penalties.seed_penalties` sets on a resumed request).
    return penalties.cumulate_penalty_output_tokens_around(original, batch)


def update_finish_state_around(original, req, new_accepted_len: int = 1):
    st = getattr(req, "lynx_spec", None)
    if st is None or req.to_finish is not None or len(req.output_ids) <= st.verified_len:
        return original(req, new_accepted_len)
    if st.finish_pending:
        # Under SGLang's overlap schedule the decode step launched before the finish was held
        # still appends its token: drop it, as SGLang drops a finished request's overshoot step
        # (its KV slot is freed before the verification, `SpecController._verify_and_resume`).
        del req.output_ids[-new_accepted_len:]
        return None
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


def release_kv_cache_before(req, tree_cache, *_flag, **_flag_kw):
    # The keep-in-cache flag (named differently per release) does not matter here.
    ctl = _spec(runtime.of_kv_pool(tree_cache.token_to_kv_pool_allocator.get_kvcache()))
    if ctl is not None:
        ctl.on_release(req)


def extend_attention_around(original, backend, *args, **kwargs):
    """SGLang's CPU (torch-native) extend attention: during a verification forward, the
    speculative positions attend as their decode steps did (`verify.extend_attention_as_decode`);
    every other extend runs SGLang's code."""
    ctl = _spec(runtime.of_kv_pool(backend.token_to_kv_pool))
    if ctl is None or not ctl.verifying:
        return original(backend, *args, **kwargs)
    return extend_attention_as_decode(original, backend, *args, **kwargs)


# (hook, adapter): `upstream.hook_table` has each hook's SGLang target and kind.
HOOKS = (
    (hook_table.SPEC_DECODE_QUEUE, process_decode_queue_before),
    (hook_table.SPEC_COMMIT, commit_transfer_after),
    (hook_table.SPEC_RESULT, process_batch_result_prebuilt_after),
    (hook_table.SPEC_FINISH, update_finish_state_around),
    (hook_table.SPEC_PENALTY, cumulate_penalty_output_tokens_around),
    (hook_table.SPEC_STREAM, accept_around),
    (hook_table.SPEC_RELEASE, release_kv_cache_before),
    (hook_table.SPEC_IDLE, is_fully_idle_around),
    (hook_table.SPEC_SAMPLE, sample_before),
    (hook_table.SPEC_ABORT, abort_request_after),
    (hook_table.SPEC_EXTEND_ATTENTION, extend_attention_around),
)
