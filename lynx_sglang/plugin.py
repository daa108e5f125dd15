"""SGLang plugin entry point: entry point `lynx` in the group `sglang.srt.plugins`.

SGLang calls `register()` early in every one of its processes (`load_plugins()`: the launcher before
parsing arguments, each scheduler and detokenizer process at start), for every user who has
lynx-sglang installed. So `register()` only does cheap things unless Lynx is selected:

always:      CPU fallbacks if SGLang's CPU engine is selected and no CUDA device exists
             (`cpu_compat.activate`, a no-op otherwise); add `lynx` to the
             `--disaggregation-transfer-backend` choices; hook `ServerArgs.add_cli_args` (the
             `--lynx-*` flags) and `ServerArgs.from_cli_args` (acts only when `lynx` was chosen).
lynx chosen: (launcher process, from the `from_cli_args` hook) check the SGLang version and the
             options, export the Lynx config to the environment for the worker processes, and
             install the backend (`install_backend`): the `TransferBackend.LYNX` enum member and the
             `get_kv_class` mapping.
worker with the Lynx config in its environment: install the backend, and in a scheduler process
             (where SGLang's prefill/decode queue modules are already imported) hook the two
             `_init_kv_manager` methods to hand the KV pool to the Lynx KV manager (which then
             completes the `runtime.LynxRuntime` every other hook finds), and register those
             hooks (`hooks`, `request_trace`, `speculation.hooks`); with
             `LYNX_SGLANG_REFERENCE_KV=1` also the codec reference mode (reference_kv).
any scheduler with `LYNX_SGLANG_TIMELINE=1` (any backend): log when each prefill forward is done
             (timeline, for the demo).

Every hook is listed with its target, kind and reason in patches/README.md.
"""

from __future__ import annotations

import logging

from . import idle, reference_kv, request_trace, timeline
from .config import LynxConfig, add_lynx_arguments
from .errors import LynxConfigError
from .names import BACKEND_SELECTED, SECRET_ENV
from .sglang_support import check_server_options
from .upstream import backend_registry, cpu_compat, hook_check, hook_table, scheduler_api, sglang_names

logger = logging.getLogger(__name__)

BACKEND_NAME = "lynx"
BACKEND_MEMBER = "LYNX"


def register() -> None:
    cpu_compat.activate()
    backend_registry.add_cli_choice(BACKEND_NAME)
    hook_check.register(hook_table.CLI_FLAGS, _add_cli_args_after)
    hook_check.register(hook_table.CLI_SELECT, _from_cli_args_around)
    config = LynxConfig.from_env()
    in_scheduler = sglang_names.pd_queues_loaded()
    if config is not None:
        install_backend()
        if in_scheduler:
            from . import hooks

            hook_check.register(hook_table.PREFILL_POOL, _init_kv_manager_after)
            hook_check.register(hook_table.DECODE_POOL, _init_kv_manager_after)
            # A malformed value fails the server's start, not its loop.
            idle.max_wait_s()
            hook_check.register(hook_table.IDLE_WAIT, hooks.on_idle_around)
            if sglang_names.scheduler_loaded():
                hook_check.register(hook_table.SEND_BATCHED, hooks.process_batch_result_around)
            _register(request_trace.HOOKS)
            hook_check.register(hook_table.RECEIVER_TOKENS, _receiver_made_after)
            if config.layer_stream:
                hook_check.register(hook_table.LAYER_STREAM_BATCH, hooks.run_batch_around)
                for hook in hook_table.LAYER_WRITTEN:
                    hook_check.register(hook, hooks.set_kv_buffer_after)
            if config.speculate:
                _register_speculation_hooks()
        if reference_kv.enabled() and sglang_names.scheduler_loaded():
            hook_check.register(hook_table.REFERENCE_KV, reference_kv.quantize_prompt_kv_before)
    elif (idle.wait_for_all_backends() and in_scheduler
          and sglang_names.scheduler_loaded()):
        # Another backend's scheduler (a benchmark baseline): only the idle wait, Lynx's own
        # schedulers have it above. Its KV manager gets a runtime holding only the waiter; its
        # transfers' statuses all pass through SGLang's common manager, whose every change then
        # wakes the wait as Lynx's backend does.
        from . import hooks

        idle.max_wait_s()
        hook_check.register(hook_table.PREFILL_POOL, _attach_idle_wait_after)
        hook_check.register(hook_table.DECODE_POOL, _attach_idle_wait_after)
        hook_check.register(hook_table.IDLE_WAIT, hooks.on_idle_around)
        hook_check.register(hook_table.IDLE_STATUS, hooks.status_updated_after)
    if timeline.enabled() and sglang_names.scheduler_loaded():
        hook_check.register(hook_table.TIMELINE, timeline.PrefillTimeline().prefill_done_before)


def _register_speculation_hooks() -> None:
    """Scheduler process: the speculation hooks act only where the process's runtime has a
    controller (a decode, once its KV manager has the pool), so a prefill scheduler pays a few
    attribute reads per call."""
    from .speculation.hooks import HOOKS

    _register(HOOKS)


def _register(hooks) -> None:
    """(hook, adapter) rows into SGLang's HookRegistry."""
    for hook, adapter in hooks:
        hook_check.register(hook, adapter)


def _add_cli_args_after(result, parser):
    add_lynx_arguments(parser)
    return result


def _from_cli_args_around(original, cls, args):
    if getattr(args, "disaggregation_transfer_backend", None) == BACKEND_NAME:
        config = LynxConfig.from_namespace(args)
        check_server_options(args)
        _check_secret(config)
        config.export_to_env()
        # Applied with the backend's hooks just below (install_backend -> apply_hooks).
        hook_check.register(hook_table.EMPTY_PROMPT, _reject_empty_prompt_before)
        install_backend()
        # The launcher's hooks (flags, the backend's classes, request validation) are in place,
        # or the launch stops here; each scheduler checks its own at start-up (the KV manager).
        hook_check.verify_applied()
        logger.info("%s%s", BACKEND_SELECTED, config)
    return original(cls, args)


def _reject_empty_prompt_before(manager, obj, input_ids, *args, **kwargs):
    """A generation request with no prompt token has no KV to transfer: SGLang would take it to
    the scheduler, where a PD pair fails it in ways that stop the server; refuse it here, where a
    ValueError becomes the client's HTTP 400."""
    if sglang_names.is_generate_request(obj) and input_ids is not None and len(input_ids) == 0:
        raise ValueError("the prompt is empty: a generation request needs at least one token")
    return None


def _check_secret(config: LynxConfig) -> None:
    """Refuse at launch what the transport would refuse in every scheduler later: listening where
    other hosts can reach it without a secret."""
    from lynx_transport.auth import is_loopback

    local_ip = sglang_names.local_ip()
    if config.load_secret() is None and not config.insecure and not is_loopback(local_ip):
        raise LynxConfigError(
            f"Lynx transport sessions need a shared secret on a non-loopback address "
            f"({local_ip}): pass --lynx-secret-file FILE (the same file on every "
            f"prefill and decode, readable by its owner only; e.g. "
            f"`(umask 077; head -c 32 /dev/urandom > FILE)`) or set ${SECRET_ENV} (hex), or "
            "--lynx-insecure on an isolated, trusted network")


def _init_kv_manager_after(kv_manager, queue):
    """Hand the KV pool to the Lynx manager SGLang just built; it completes the process's runtime
    (`LynxKVManager.attach_kv_pool`)."""
    from .backend.manager import LynxKVManager

    if isinstance(kv_manager, LynxKVManager):
        kv_manager.attach_kv_pool(queue.token_to_kv_pool)
    return kv_manager


def _receiver_made_after(decode_req, queue, req, *args, **kwargs):
    """SGLang made a request's KV receiver: tell it how many tokens of KV the prefill sends (the
    prompt, or what a rebootstrap recomputes), which SGLang's KV indices do not say when they are
    pages (`LynxKVManager.register_rx_room`)."""
    receiver = getattr(decode_req, "kv_receiver", None)
    if receiver is not None:
        receiver.lynx_kv_tokens = scheduler_api.prefill_kv_tokens(queue, req)
    return decode_req


def _attach_idle_wait_after(kv_manager, queue):
    """Another backend's KV manager (`names.IDLE_WAIT_ENV`): a runtime with only the idle wait
    (and the default recorder), found by the `on_idle` and `update_status` hooks."""
    from .idle import IdleWaiter
    from .recorder import Recorder
    from .runtime import LynxRuntime, attach

    recorder = Recorder.for_process()
    attach(kv_manager, LynxRuntime(idle=IdleWaiter(recorder.metrics), recorder=recorder))
    return kv_manager


def install_backend() -> None:
    """Make `TransferBackend("lynx")` and `get_kv_class(TransferBackend.LYNX, ...)` work
    (`upstream.backend_registry`). Idempotent."""
    if not backend_registry.add_backend_member(BACKEND_MEMBER, BACKEND_NAME):
        return
    hook_check.register(hook_table.KV_CLASSES,
                        backend_registry.kv_class_around(BACKEND_MEMBER, _backend_classes))
    # Plugins registered during load_plugins() are applied by SGLang right after; this call
    # covers the launcher process, where the backend is chosen later (at argument parsing).
    hook_check.apply()


def _backend_classes() -> backend_registry.BackendClasses:
    from .backend.conn import LynxKVBootstrapServer, LynxKVReceiver, LynxKVSender
    from .backend.manager import LynxKVManager

    return backend_registry.BackendClasses(LynxKVManager, LynxKVSender, LynxKVReceiver,
                                           LynxKVBootstrapServer)
