"""Checks of one encode run's inputs that the host does not wait for: each is a flag computed on
the run's device and the error to raise if it is set. `DeferredChecks.start` queues the flags'
copy to the host beside the run's own device-to-host copies; `PendingChecks.finish` reads them
once they have landed and raises the first failed check's error, computed then.

Used by the serving encode (`fused.encode_run_start`, whose `PendingRun.finish` calls `finish`)
for the slot range check of `fused._run` and the refusals of `codec.quantization_input`: read at
once, each was a host wait for the device in every run (a read-back of `aminmax`), which stalls
the thread that queues the next layer's encode. The error is the one the immediate check raises,
computed only when a flag is set (a host wait then, on the failure's path only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .chunk_copy import COPY_TIMEOUT_S, CopyEvent, await_event, copier_for
from .spec import CodecError


class DeferredChecks:
    """The checks of one run, in the order they would have been made."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._errors: list[Callable[[], CodecError]] = []

    def add(self, failed: torch.Tensor, error: Callable[[], CodecError]) -> None:
        """`failed`: a one-value bool tensor on the run's device, not read here; `error()`: the
        CodecError to raise if it is true (called on the host once it is known to be)."""
        self._flags.append(failed.reshape(()))
        self._errors.append(error)

    def start(self) -> PendingChecks:
        """Queue the flags' copy to the host (a CUDA run's into page-locked memory, after the
        work queued so far on the current stream; a CPU run's at once)."""
        if not self._flags:
            return PendingChecks([], None, None, None)
        flags = torch.stack(self._flags).to(torch.uint8)
        host = torch.empty(len(self._flags), dtype=torch.uint8,
                           pin_memory=flags.device.type == "cuda")
        copier = copier_for(flags.device)
        copier.copy(flags, host.numpy())
        return PendingChecks(self._errors, host, copier.done(), copier)


@dataclass
class PendingChecks:
    """A run's flags on their way to the host; `finish` raises the first failed check's error."""

    errors: list[Callable[[], CodecError]]
    host: torch.Tensor | None
    event: CopyEvent | None
    copier: object  # holds the device flags until their copy has run

    def finish(self, timeout_s: float = COPY_TIMEOUT_S) -> None:
        if self.event is not None:
            await_event(self.event, time.monotonic() + timeout_s,
                        f"the device-to-host copy of a run's input checks did not complete "
                        f"within {timeout_s:g} s")
            self.event = None
        self.copier = None
        if self.host is None:
            return
        for failed, error in zip(self.host.tolist(), self.errors, strict=True):
            if failed:
                raise error()
