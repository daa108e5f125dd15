"""The decode scheduler's own steps on a transferred request, as `request` records of
`lynx_sglang.trace`: SGLang committed it to its running batch (`committed`: the scheduler's first
step on it) and streamed its first token (`first_token_out`); and the request id handed to the KV
receiver SGLang makes for it (the decode's transfer record carries it).

Hook adapters registered by `plugin` in every decode scheduler of a Lynx server (speculative or
not); scheduler thread only. The record rides on SGLang's request (`ATTR`) from its commit to its
first token out, so a request that never streams (aborted first) takes it along when it goes.
The record is emitted through the process's recorder (`runtime.LynxRuntime.recorder`), found from
the KV pool of SGLang's batch result processor.
"""

from __future__ import annotations

from . import runtime
from .trace import Trace
from .upstream import hook_table

# The attribute of SGLang's Req holding its `request` record between the two marks.
ATTR = "lynx_request_trace"


def create_receiver_after(result, queue, req, *args, **kwargs):
    """SGLang made the request's KV receiver: tell it the request id (SGLang passes only the
    bootstrap room), so the decode's transfer record names the request."""
    receiver = getattr(result, "kv_receiver", None)
    if receiver is not None:
        receiver.lynx_rid = req.rid
    return result


def commit_transfer_after(result, queue, decode_req):
    req = decode_req.req
    room = getattr(req, "bootstrap_room", None)
    if room is not None:
        tr = Trace("request", room)
        tr.mark("committed")
        tr.facts["rid"] = req.rid
        setattr(req, ATTR, tr)
    return result


def process_batch_result_prebuilt_after(result, processor, batch):
    rt = runtime.of_kv_pool(processor.token_to_kv_pool_allocator.get_kvcache())
    for req in batch.reqs:
        tr = getattr(req, ATTR, None)
        if tr is not None:
            setattr(req, ATTR, None)
            tr.mark("first_token_out")
            if rt is not None:
                rt.recorder.emit(tr)
    return result


# (hook, adapter): `upstream.hook_table` has each hook's SGLang target and kind.
HOOKS = (
    (hook_table.TRACE_RECEIVER, create_receiver_after),
    (hook_table.TRACE_COMMIT, commit_transfer_after),
    (hook_table.TRACE_RESULT, process_batch_result_prebuilt_after),
)
