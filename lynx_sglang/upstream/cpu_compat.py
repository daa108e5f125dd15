"""What SGLang 0.5.23 needs to serve on a machine without CUDA, packaged as import-time fallbacks.

Owns three things, all inactive unless SGLang's CPU engine is selected (`SGLANG_USE_CPU_ENGINE=1`)
and no CUDA device is visible, so nothing here ever runs on a GPU box:

- `sgl_kernel` and `torchvision` fallbacks: a meta-path finder that serves a stub module only when
  the real package cannot be found. SGLang imports both at module load (sgl_kernel in
  `mem_cache/allocation.py`, torchvision via `configs/`); the CUDA sgl-kernel wheel and the PyPI
  torchvision do not load next to a CPU torch. Of sgl_kernel, only `assign_req_to_token_pool_cpu`
  is called on the Llama path (given a torch implementation here); every other attribute is a
  function that raises with the op's name, so a missing op fails loudly instead of silently.
- CPU guards applied right after SGLang modules load (post-import patches), see
  patches/README.md: `mem_cache.pool_host.common._cuda_host_register` becomes a no-op (the decode
  server's host KV pool pins memory with `torch.cuda.cudart()`),
  `MooncakeKVSender.supports_host_tensor_indices` becomes False (prefill would otherwise take a
  pinned-memory + `torch.cuda.Event` path), and the host-memory reserve SGLang keeps free before
  sizing a HiCache host pool (`pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES`, 10 GiB, meant
  for a GPU server's host) drops to 1 GiB: on a CPU box the "device" KV pool is host memory too,
  and the decode server refused to start whenever less than 10 GiB was free. And
  `disaggregation.prefill` sees `torch.cuda.Event` as `torch.cpu.Event` (records nothing, always
  complete): with the overlap scheduler, `maybe_send_cached_prefix_chunk` creates a CUDA event to
  order the early send of a radix-cached prefix after the previous forward's writes, and on CPU
  `torch.cuda.Event()` raised ("Tried to instantiate dummy base class Event") and killed the
  prefill on the first prompt with a cached prefix. On CPU that forward has returned before the
  scheduler gets there (no asynchronous streams), so an always-complete event is the exact order.

Called by `lynx_sglang.plugin` (SGLang's plugin hook, main process) and at import of
`lynx_sglang.serve` (every process of a server started through it, see that module for why the
plugin alone is too late in SGLang's spawned scheduler processes).
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable

logger = logging.getLogger(__name__)

STUBBED_PACKAGES = ("sgl_kernel", "torchvision")
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


def cpu_engine_selected() -> bool:
    return os.environ.get(CPU_ENGINE_ENV, "0") == "1"


def cuda_device_present() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def activate() -> bool:
    """Install the fallbacks and guards if SGLang runs on its CPU engine with no CUDA device.

    Idempotent (the import system is process-wide: our finder on `sys.meta_path` is the mark
    that they are installed); returns whether they are active. Cheap when the CPU engine is not
    selected (one environment lookup, torch is not imported).
    """
    if any(isinstance(finder, _FallbackStubFinder) for finder in sys.meta_path):
        return True
    if not cpu_engine_selected() or cuda_device_present():
        return False
    sys.meta_path.insert(0, _FallbackStubFinder())
    post_import = _PostImportPatcher(
        {
            "sglang.srt.mem_cache.pool_host.common": _guard_cuda_host_register,
            "sglang.srt.disaggregation.mooncake.conn": _guard_mooncake_host_indices,
            "sglang.srt.mem_cache.pool_host.base": _cpu_host_memory_reserve,
            "sglang.srt.disaggregation.prefill": _cpu_events_in_prefill,
        }
    )
    sys.meta_path.insert(0, post_import)
    post_import.patch_already_loaded()
    logger.info("lynx cpu_compat: sgl_kernel/torchvision fallbacks and CPU guards active")
    return True


# ---- sgl_kernel / torchvision fallbacks -------------------------------------------------------


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """Torch version of sgl_kernel's CPU op: req_to_token[row, start:end] = next slots of
    out_cache_loc, rows in order (pool_len is the row length, unused here)."""
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(
                req_to_token.dtype
            )
        offset += n


class InterpolationMode(enum.Enum):
    """torchvision.transforms.InterpolationMode: SGLang's configs use its members at import."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    """Placeholder for any stubbed attribute: importable, fails with its name when used."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._name} is not available: lynx_sglang.upstream.cpu_compat provides only an import "
            "stub on this CPU-only machine"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if self.__name__ == "sgl_kernel" and attr == "assign_req_to_token_pool_cpu":
            return assign_req_to_token_pool_cpu
        if attr == "InterpolationMode" and self.__name__.startswith("torchvision"):
            return InterpolationMode
        return _Unavailable(f"{self.__name__}.{attr}")


class _FallbackStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stub for STUBBED_PACKAGES (and submodules) only when no real one is installed."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in STUBBED_PACKAGES:
            return None
        if top == fullname and self._real_spec(fullname) is not None:
            return None
        if top != fullname and not isinstance(sys.modules.get(top), _StubModule):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def _real_spec(self, fullname):
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _PostImportPatcher):
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, None) if find else None
            if spec is not None:
                return spec
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+lynx.cpu.stub"
        return module

    def exec_module(self, module):
        pass


# ---- post-import CPU guards -------------------------------------------------------------------


def _guard_cuda_host_register(module: types.ModuleType) -> None:
    def _cuda_host_register(buffer, registration_granularity_bytes=None):
        # Pinning host memory needs the CUDA runtime; on CPU the pool is ordinary memory.
        return None

    module._cuda_host_register = _cuda_host_register


def _guard_mooncake_host_indices(module: types.ModuleType) -> None:
    module.MooncakeKVSender.supports_host_tensor_indices = False


CPU_HOST_MEMORY_RESERVE_BYTES = 1 << 30


def _cpu_host_memory_reserve(module: types.ModuleType) -> None:
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = CPU_HOST_MEMORY_RESERVE_BYTES


def _cpu_events_in_prefill(module: types.ModuleType) -> None:
    # Only this module's `torch` name changes: every other torch.cuda use in the process still
    # fails loudly on CPU.
    module.torch = _TorchWithCpuEvents(module.torch)


class _TorchWithCpuEvents(types.ModuleType):
    """`torch` as one patched module sees it: `torch.cuda.Event` is `torch.cpu.Event`; every
    other attribute is the real torch's (and torch.cuda's)."""

    def __init__(self, torch: types.ModuleType):
        super().__init__(torch.__name__)
        self._torch = torch
        self.cuda = _CudaWithCpuEvents(torch.cuda, torch.cpu.Event)

    def __getattr__(self, attr: str):
        return getattr(self._torch, attr)


class _CudaWithCpuEvents(types.ModuleType):
    def __init__(self, cuda: types.ModuleType, event: type):
        super().__init__(cuda.__name__)
        self._cuda = cuda
        self.Event = event

    def __getattr__(self, attr: str):
        return getattr(self._cuda, attr)


class _PostImportPatcher(importlib.abc.MetaPathFinder):
    """Runs a patch function on a module right after it has executed, before importers bind
    names from it (so `from module import fn` picks up the patched fn)."""

    def __init__(self, patches: dict[str, Callable[[types.ModuleType], None]]):
        self._patches = dict(patches)
        self._done: set[str] = set()

    def patch_already_loaded(self) -> None:
        for name, patch in self._patches.items():
            module = sys.modules.get(name)
            if module is not None and name not in self._done:
                patch(module)
                self._done.add(name)

    def find_spec(self, fullname, path=None, target=None):
        patch = self._patches.get(fullname)
        if patch is None or fullname in self._done:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        original_exec = spec.loader.exec_module
        done = self._done

        def exec_module(module):
            original_exec(module)
            patch(module)
            done.add(fullname)

        spec.loader.exec_module = exec_module
        return spec
