"""SGLang's own names that Lynx's runtime uses as values (an enum member, a pool class, a device
helper), one function each, so that the modules calling them need not import SGLang.

Each imports its SGLang module when called: the callers run where SGLang is loaded already (a
scheduler's hook, a KV manager), and a process that never uses them never imports them.

Called by `lynx_sglang.timeline` (`is_prefill_scheduler`), `backend.pool` (`is_plain_mla_pool`),
`backend.transport_setup` (`ib_devices_for_gpu`) and `lynx_sglang.plugin` (`is_generate_request`,
`local_ip`, `pd_queues_loaded`, `scheduler_loaded`).
"""

from __future__ import annotations

import sys


def is_prefill_scheduler(scheduler: object) -> bool:
    """Whether an SGLang scheduler runs the prefill side of PD disaggregation."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(scheduler, "disaggregation_mode", None) == DisaggregationMode.PREFILL


def is_plain_mla_pool(pool: object) -> bool:
    """Whether `pool` is SGLang's plain MLA latent pool itself (not a subclass such as the DSA or
    FP4 pools, whose rows hold other layouts)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return type(pool) is MLATokenToKVPool


def ib_devices_for_gpu(sglang_devices: str, gpu_id: int) -> str:
    """The RDMA device(s) SGLang's `--disaggregation-ib-device` gives GPU `gpu_id` (a list, a
    per-GPU JSON map or a JSON file of one), as SGLang's Mooncake engine resolves them; a
    ValueError says what is malformed."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_ib_devices_for_gpu,
    )

    return get_ib_devices_for_gpu(sglang_devices, gpu_id) or ""


def is_generate_request(obj: object) -> bool:
    """Whether a request object reaching SGLang's tokenizer manager is a generation request."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    return isinstance(obj, GenerateReqInput)


def local_ip() -> str:
    """The address SGLang's servers advertise for this host (its own choice, as its bootstrap
    registration makes it)."""
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto()


# Modules a scheduler process has imported before it calls load_plugins(); hooking their queues
# anywhere else would import them (tens of seconds) into processes that never use them.
_QUEUE_MODULES = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode")
_SCHEDULER_MODULE = "sglang.srt.managers.scheduler"


def pd_queues_loaded() -> bool:
    """Whether this process has imported SGLang's prefill and decode queue modules (a scheduler
    process does before it loads plugins); never imports them."""
    return all(name in sys.modules for name in _QUEUE_MODULES)


def scheduler_loaded() -> bool:
    """Whether this process has imported SGLang's scheduler module; never imports it."""
    return _SCHEDULER_MODULE in sys.modules
