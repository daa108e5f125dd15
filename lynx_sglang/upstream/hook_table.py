"""Every SGLang function Lynx hooks, by logical name, and every SGLang method Lynx's subclasses
override or whose logic Lynx copies (`FOLLOWED`).

A `Hook` is one use of a target: its logical name (what Lynx does there), the dotted SGLang path
and the `HookRegistry` kind. Adapters refer to hooks by these constants, never by an SGLang
path; patches/README.md says why each exists. `lynx_sglang.upstream.fingerprints` fingerprints
every target and every `FOLLOWED` name per supported SGLang release. Pure data: imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hook:
    name: str  # logical: what Lynx does there
    target: str  # SGLang's dotted path
    kind: str  # HookRegistry's HookType name: BEFORE, AFTER or AROUND


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_DECODE = "sglang.srt.disaggregation.decode"
_POOL = "sglang.srt.mem_cache.memory_pool"
_BATCH_RESULT = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                 "SchedulerBatchResultProcessor.process_batch_result_prebuilt")

# ---- the launcher process: flags, the backend's classes, request validation
CLI_FLAGS = Hook("cli.flags", "sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER")
CLI_SELECT = Hook("cli.select_backend", "sglang.srt.server_args.ServerArgs.from_cli_args",
                  "AROUND")
KV_CLASSES = Hook("backend.kv_classes", "sglang.srt.disaggregation.utils.get_kv_class", "AROUND")
EMPTY_PROMPT = Hook("request.reject_empty_prompt",
                    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                    "BEFORE")
# ---- the scheduler process: the transfer path
PREFILL_POOL = Hook("backend.prefill_pool",
                    "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._init_kv_manager",
                    "AFTER")
DECODE_POOL = Hook("backend.decode_pool", f"{_DECODE}.DecodePreallocQueue._init_kv_manager",
                   "AFTER")
IDLE_WAIT = Hook("idle.wait", f"{_SCHED}.on_idle", "AROUND")
IDLE_STATUS = Hook("idle.status_changed",
                   "sglang.srt.disaggregation.common.conn.CommonKVManager.update_status", "AFTER")
SEND_BATCHED = Hook("prefill.send_batched", f"{_SCHED}.process_batch_result", "AROUND")
LAYER_STREAM_BATCH = Hook("prefill.layer_stream_batch", f"{_SCHED}.run_batch", "AROUND")
LAYER_WRITTEN = (
    Hook("prefill.layer_written.mha", f"{_POOL}.MHATokenToKVPool.set_kv_buffer", "AFTER"),
    Hook("prefill.layer_written.mla", f"{_POOL}.MLATokenToKVPool.set_kv_buffer", "AFTER"),
    Hook("prefill.layer_written.mla_split", f"{_POOL}.MLATokenToKVPool.set_mla_kv_buffer",
         "AFTER"),
)
RECEIVER_TOKENS = Hook("decode.receiver_tokens",
                       f"{_DECODE}.DecodePreallocQueue._create_receiver_and_enqueue", "AFTER")
# ---- tools riding on a scheduler: the codec reference mode, the demo's timeline
REFERENCE_KV = Hook("reference_kv.quantize_prompt", f"{_SCHED}.process_batch_result", "BEFORE")
TIMELINE = Hook("timeline.prefill_done", f"{_SCHED}.process_batch_result", "BEFORE")
# ---- request traces (request_trace)
TRACE_RECEIVER = Hook("trace.receiver_made",
                      f"{_DECODE}.DecodePreallocQueue._create_receiver_and_enqueue", "AFTER")
TRACE_COMMIT = Hook("trace.transfer_committed",
                    f"{_DECODE}.DecodeTransferQueue._commit_transfer_to_req", "AFTER")
TRACE_RESULT = Hook("trace.batch_result", _BATCH_RESULT, "AFTER")
# ---- speculation (speculation.hooks)
SPEC_DECODE_QUEUE = Hook("spec.decode_queue",
                         f"{_DECODE}.SchedulerDisaggregationDecodeMixin.process_decode_queue",
                         "BEFORE")
SPEC_COMMIT = Hook("spec.transfer_committed",
                   f"{_DECODE}.DecodeTransferQueue._commit_transfer_to_req", "AFTER")
SPEC_RESULT = Hook("spec.batch_result", _BATCH_RESULT, "AFTER")
SPEC_FINISH = Hook("spec.finish_state", "sglang.srt.managers.schedule_batch.Req.update_finish_state",
                   "AROUND")
SPEC_PENALTY = Hook("spec.penalty_tokens",
                    "sglang.srt.managers.schedule_batch.ScheduleBatch."
                    "cumulate_penalty_output_tokens", "AROUND")
SPEC_STREAM = Hook("spec.stream_accept",
                   "sglang.srt.managers.scheduler_components.output_streamer."
                   "_GenerationStreamAccumulator.accept", "AROUND")
SPEC_RELEASE = Hook("spec.release_kv", "sglang.srt.mem_cache.common.release_kv_cache", "BEFORE")
SPEC_IDLE = Hook("spec.fully_idle", f"{_SCHED}.is_fully_idle", "AROUND")
SPEC_SAMPLE = Hook("spec.sample", "sglang.srt.model_executor.model_runner.ModelRunner.sample",
                   "BEFORE")
SPEC_ABORT = Hook("spec.abort", f"{_SCHED}.abort_request", "AFTER")
SPEC_EXTEND_ATTENTION = Hook("spec.extend_attention",
                             "sglang.srt.layers.attention.torch_native_backend."
                             "TorchNativeAttnBackend._run_sdpa_forward_extend", "AROUND")

HOOKS: tuple[Hook, ...] = (
    CLI_FLAGS, CLI_SELECT, KV_CLASSES, EMPTY_PROMPT, PREFILL_POOL, DECODE_POOL, IDLE_WAIT,
    IDLE_STATUS, SEND_BATCHED, LAYER_STREAM_BATCH, *LAYER_WRITTEN, RECEIVER_TOKENS,
    REFERENCE_KV, TIMELINE, TRACE_RECEIVER, TRACE_COMMIT, TRACE_RESULT, SPEC_DECODE_QUEUE,
    SPEC_COMMIT, SPEC_RESULT, SPEC_FINISH, SPEC_PENALTY, SPEC_STREAM, SPEC_RELEASE, SPEC_IDLE,
    SPEC_SAMPLE, SPEC_ABORT, SPEC_EXTEND_ATTENTION,
)

# SGLang classes Lynx's transfer backend subclasses, with the methods it overrides
# (`backend.manager.LynxKVManager`, `backend.conn.Lynx*`; tests/sglang/test_plugin.py checks
# this list against the classes), and SGLang logic Lynx copies and must track: the torch
# sampler's top-k/top-p/min-p filter (`upstream.sampling_filter`). The sender's and receiver's base
# depends on the release's layout (`upstream.adapter`): the Common classes where they carry
# send/poll/send_metadata (0.5.23), Mooncake's own where those are Mooncake's (0.5.21, 0.5.22);
# both are followed, so a release's fingerprints cover whichever one it uses. The manager's
# `_make_worker_recv` is where a prefill sees a decode's abort before SGLang handles it (in
# `start_prefill_thread`'s loop, inline in 0.5.21, `_handle_abort_notification` from 0.5.22).
_SENDER_OVERRIDES = ("get_transfer_metric",)
_RECEIVER_OVERRIDES = ("init", "_get_bootstrap_info_from_server", "send_metadata", "poll",
                       "clear", "abort", "failure_exception")
SUBCLASSED: dict[str, tuple[str, ...]] = {
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager": (
        "__init__", "init_engine", "register_buffer_to_engine", "deregister_buffer_to_engine",
        "get_session_id", "_register_topology_row", "_connect", "add_transfer_request",
        "record_failure", "update_status", "_make_worker_recv"),
    "sglang.srt.disaggregation.common.conn.CommonKVSender": _SENDER_OVERRIDES,
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender": _SENDER_OVERRIDES,
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver": _RECEIVER_OVERRIDES,
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVReceiver": _RECEIVER_OVERRIDES,
    "sglang.srt.disaggregation.common.conn.CommonKVBootstrapServer": (
        "__init__", "_setup_routes", "_handle_route_put", "_handle_route_get"),
}
COPIED = ("sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch",)
# SGLang internals the speculation controller calls without hooking them (patches/README.md,
# "SGLang internals the speculation controller calls"), and `Req.__init__`, where the request
# attributes it saves and restores are made (0.5.22's lacked one: only an end-to-end test saw it).
_SB = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo"
CALLED = (
    "sglang.srt.managers.schedule_batch.ScheduleBatch.init_new",
    "sglang.srt.managers.schedule_batch.Req.__init__",
    "sglang.srt.managers.schedule_batch.Req.update_reasoning_tokens",
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
    "sglang.srt.layers.logits_processor.LogitsProcessor._get_logits",
    "sglang.srt.layers.logprob_processor.OutputLogprobProcessor.compute_logprobs",
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.free_kv_row",
    "sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch",
    f"{_SB}.from_schedule_batch", f"{_SB}.copy_for_forward", f"{_SB}.apply_logits_bias",
    f"{_SB}.update_regex_vocab_mask",
    # `--disaggregation-ib-device` resolved as SGLang's Mooncake engine does (sglang_names)
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.get_ib_devices_for_gpu",
    # the prefill's receive loop, each message of which passes the manager's _make_worker_recv
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.start_prefill_thread",
    # what the room's accessors and wrappers reach (upstream.scheduler_api, upstream.kv_transfer)
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._rebootstrap_prefill_len",
    "sglang.srt.disaggregation.utils.prepare_abort",
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_update_reasoning_tokens",
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver.disconnect_endpoint",
    "sglang.srt.disaggregation.common.utils.AuxDataCodec.serialize_data_from_buffer",
    "sglang.srt.disaggregation.common.utils.AuxDataCodec.deserialize_data_to_buffer",
)


def followed() -> tuple[str, ...]:
    """Every dotted SGLang name Lynx depends on, once each, sorted: the hook targets, the
    overridden methods, the copied logic and the internals it calls (what `fingerprints`
    fingerprints)."""
    names = {h.target for h in HOOKS} | set(COPIED) | set(CALLED)
    names |= {f"{cls}.{m}" for cls, methods in SUBCLASSED.items() for m in methods}
    return tuple(sorted(names))
