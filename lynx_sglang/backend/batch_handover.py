"""Hands the rooms of one prefill forward to the sender together: an AROUND hook on SGLang's
`Scheduler.process_batch_result` (the scheduler thread, where SGLang calls the backend's `send`
for each request the forward completed) runs it inside `PrefillSender.batched`, so the rooms
bound for one decode go to its worker as one group and every room's Anchor goes out before any
room's Residual. Without it, the first room's whole transfer (an exact Residual is encoded after
its Anchor) came before the second room's Anchor.

Registered by `lynx_sglang.plugin` in scheduler processes; acts once a prefill's sender is bound
here (`bind`), so a decode's results pass through untouched. Layer-streamed rooms reach their
worker as a group already (`backend.layer_stream`); this serves the rooms sent after their
forward (pools where layer streaming is off, a prompt that was not streamed).
"""

from __future__ import annotations

_sender = None


def bind(sender) -> None:
    """Group the hand-overs of this process's prefill `sender` (a `PrefillSender`)."""
    global _sender
    _sender = sender


def process_batch_result_around(original, scheduler, *args, **kwargs):
    sender = _sender
    if sender is None:
        return original(scheduler, *args, **kwargs)
    with sender.batched():
        return original(scheduler, *args, **kwargs)
