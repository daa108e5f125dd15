"""Registered memory regions: a local buffer given by address + length (or any buffer object).

A `Region` never copies: it records the address and length of memory the *caller* owns, keeps a
reference to the buffer object when one was given (so it cannot be garbage-collected while
registered) and exposes a `memoryview` over the bytes for backends that need one (tcp).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .types import RegionError


@dataclass(eq=False)
class Region:
    """One registered region. Created by `Endpoint.register`; do not construct directly.

    id: endpoint-unique u32 used on the wire; addr/length: the memory; writable: whether peers may
    write into it (a read-only buffer can only be a source); backend_info: what the backend needs
    to publish to peers (e.g. an rkey), filled at registration; backend_handle: the backend's own
    object (e.g. a pyverbs MR); never sent.
    """

    id: int
    addr: int
    length: int
    writable: bool
    name: str = ""
    owner: Any = field(default=None, repr=False)  # keeps the caller's buffer object alive
    backend_info: dict = field(default_factory=dict)
    backend_handle: Any = field(default=None, repr=False)
    _view: memoryview | None = field(default=None, repr=False)

    @property
    def view(self) -> memoryview:
        """A writable-if-possible 'B' memoryview over the whole region (zero-copy)."""
        if self._view is None:
            if self.length == 0:
                self._view = memoryview(bytearray(0))
            else:
                raw = (ctypes.c_uint8 * self.length).from_address(self.addr)
                self._view = memoryview(raw).cast("B")
                if not self.writable:
                    self._view = self._view.toreadonly()
        return self._view

    def slice(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.length:
            raise RegionError(
                f"region {self.id} ({self.length} B): [{offset}, {offset + length}) out of range"
            )
        return self.view[offset : offset + length]


def describe_buffer(obj: Any, length: int | None) -> tuple[int, int, bool, Any]:
    """(addr, length, writable, owner) for a buffer object or an integer address.

    - int address: `length` is required; memory is assumed writable; the caller keeps it alive.
    - numpy array / bytearray / memoryview / mmap / anything with the buffer protocol: must be
      C-contiguous; `length` (optional) registers only the first `length` bytes.
    Torch tensors: pass `t.data_ptr()` and `t.numel() * t.element_size()` (CPU memory for tcp).
    """
    if isinstance(obj, int):
        if length is None or length < 0:
            raise RegionError("registering a raw address needs a non-negative length")
        if obj == 0 and length:
            raise RegionError("null address")
        return obj, int(length), True, None
    try:
        arr = np.frombuffer(obj, dtype=np.uint8)
    except (TypeError, ValueError):
        try:
            arr = np.asarray(obj)
            if not arr.flags.c_contiguous:
                raise RegionError("region buffer must be C-contiguous") from None
            arr = arr.reshape(-1).view(np.uint8)
        except RegionError:
            raise
        except Exception as exc:  # pragma: no cover - exotic objects
            raise RegionError(f"cannot register {type(obj).__name__}: {exc}") from exc
    n = arr.nbytes if length is None else int(length)
    if n < 0 or n > arr.nbytes:
        raise RegionError(f"length {n} outside buffer of {arr.nbytes} B")
    return int(arr.ctypes.data), n, bool(arr.flags.writeable), (obj, arr)
