"""The composition of one Lynx scheduler process: `LynxRuntime`, the components SGLang's hooks act
on, and how a hook finds it from the SGLang object it was given. No module holds one.

Built by the KV manager (`backend.manager.LynxKVManager`), in two steps: at construction the
process's recorder (`recorder.Recorder`: its metric labels and trace sink, also handed to every
component that records) and the idle waiter (its transfer threads notify it from the start); when
SGLang hands it the KV pool (`attach_kv_pool`, from the plugin's `_init_kv_manager` hook) the rest
by role: on a prefill the sender and, on a CPU or CUDA pool, the layer streamer; on a speculative
decode the speculation controller.
The manager holds it as `lynx_runtime`, and so does the KV pool it was handed (`attach`).

Found by the hook adapters (`lynx_sglang.hooks`, `speculation.hooks`):
- from SGLang's `Scheduler` (`of_scheduler`): the KV manager of its PD queue;
- from inside the model and the KV cache, which have no path to the scheduler (`of_kv_pool`): the
  KV pool they hold (`MHATokenToKVPool` itself, `ModelRunner.token_to_kv_pool`, the attention
  backend's `token_to_kv_pool`, the tree cache's and the result processor's allocator), which is
  the one the manager was handed;
- from another backend's KV manager (`of_manager`), where the plugin attaches a runtime with only
  the idle waiter and a default recorder (`names.IDLE_WAIT_ENV`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: another backend's scheduler builds an idle-only runtime
    from .backend.prefill.layer_stream import LayerStreamer
    from .backend.prefill.sender import PrefillSender
    from .idle import IdleWaiter
    from .recorder import Recorder
    from .speculation.controller import SpecController

# The attribute holding the runtime on the SGLang objects it rides on.
ATTR = "lynx_runtime"


@dataclass(frozen=True)
class LynxRuntime:
    """What one scheduler's hooks act on; fixed once the KV pool is attached."""

    idle: IdleWaiter
    # Where this process's metrics and trace records go; the hooks that record find it here.
    recorder: Recorder
    # Prefill: the hand-over of one forward's rooms runs inside `sender.batched`.
    sender: PrefillSender | None = None
    # Prefill on a CPU or CUDA pool with --lynx-layer-stream.
    layer_stream: LayerStreamer | None = None
    # Decode with --lynx-speculate.
    spec: SpecController | None = None


def attach(owner, runtime: LynxRuntime) -> None:
    """Let the hooks find `runtime` from `owner` (a KV pool, another backend's KV manager)."""
    setattr(owner, ATTR, runtime)


def of_manager(kv_manager) -> LynxRuntime | None:
    return getattr(kv_manager, ATTR, None)


def of_scheduler(scheduler) -> LynxRuntime | None:
    """The runtime of the KV manager SGLang built for `scheduler`'s prefill or decode queue."""
    queue = (getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
             or getattr(scheduler, "disagg_decode_prealloc_queue", None))
    return of_manager(getattr(queue, "kv_manager", None))


def of_kv_pool(pool) -> LynxRuntime | None:
    return getattr(pool, ATTR, None)
