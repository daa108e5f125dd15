"""Whether GPUDirect RDMA (the NIC reading and writing GPU memory itself) is possible on this
machine for one RDMA device, and why or why not.

Called at start-up by the Lynx KV manager (`lynx_sglang.backend.manager`, one log line for the
verbs transport) and by `lynx-sglang doctor` (`tools/doctor.py`, its `gpudirect` line). It only
looks: nothing here registers GPU memory. The verbs data path stages in host memory whatever this
finds; registering device memory is the step that needs a GPU+NIC machine to build and test.

Two ways let an NVIDIA GPU's memory be registered with an RDMA NIC: the peer-memory kernel module
(`nvidia_peermem`, shipped with the NVIDIA driver, or the legacy out-of-tree `nv_peer_mem`), or
dma-buf (`ibv_reg_dmabuf_mr`, pyverbs' `DmaBufMR`). The dma-buf verdict is necessary, not
sufficient: whether the NIC's driver takes dma-buf memory (soft-RoCE does not) and whether the GPU
exports it (NVIDIA's open kernel modules) shows only when registering, so its reason says so.
The probes (/sys, /proc and the pyverbs import) are fields of `Probes`, so tests give a fake tree
and a fake pyverbs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Newest first: the driver's own module wins over the legacy one in the reason.
PEER_MEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
DMA_BUF = "dma-buf"


@dataclass(frozen=True)
class GpuDirect:
    """The verdict for one RDMA device. mechanism: the module name of `PEER_MEM_MODULES` or
    `DMA_BUF` when available, else None; reason: what was found, for a log line or doctor."""

    available: bool
    mechanism: str | None
    reason: str

    def summary(self) -> str:
        """One line saying what the verbs transport does with this: it stages in host memory
        either way (GPU registration is not implemented)."""
        if not self.available:
            return f"verbs staging in host memory: {self.reason}"
        return (f"GPUDirect RDMA available ({self.mechanism}): {self.reason}; verbs still "
                "stages in host memory (registering GPU memory with the NIC is not "
                "implemented yet)")


def _load_pyverbs() -> Any | None:
    """What the dma-buf probe needs from pyverbs (Context, PyverbsError, DmaBufMR or None when
    this pyverbs predates it), or None without pyverbs."""
    try:
        import pyverbs.mr as mr
        from pyverbs.device import Context
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError:
        return None
    return SimpleNamespace(Context=Context, PyverbsError=PyverbsError,
                           DmaBufMR=getattr(mr, "DmaBufMR", None))


@dataclass(frozen=True)
class Probes:
    """Where the checks look: the kernel's module tree and list, the RDMA device class, and a
    loader of pyverbs (returning None when it is not importable)."""

    sys_module: Path = Path("/sys/module")
    proc_modules: Path = Path("/proc/modules")
    infiniband: Path = Path("/sys/class/infiniband")
    pyverbs: Callable[[], Any | None] = field(default=_load_pyverbs)


def loaded_peer_mem_module(probes: Probes) -> str | None:
    """The first of `PEER_MEM_MODULES` that is loaded, seen in /sys/module or /proc/modules (a
    container may mount one without the other), else None."""
    try:
        listed = {line.split(maxsplit=1)[0] for line in
                  probes.proc_modules.read_text().splitlines() if line.strip()}
    except OSError:  # no /proc/modules (a container without it): /sys/module alone decides
        listed = set()
    for name in PEER_MEM_MODULES:
        if name in listed or (probes.sys_module / name).is_dir():
            return name
    return None


def _dma_buf(device: str, probes: Probes) -> str | None:
    """None if pyverbs has `DmaBufMR` and `device` opens, else why not."""
    v = probes.pyverbs()
    if v is None:
        return "pyverbs is not importable"
    if getattr(v, "DmaBufMR", None) is None:
        return "this pyverbs has no DmaBufMR (rdma-core 34 or newer adds dma-buf)"
    try:
        ctx = v.Context(name=device)
    except v.PyverbsError as exc:
        return f"RDMA device {device} does not open: {exc}"
    ctx.close()
    return None


def detect(device: str | None, probes: Probes | None = None) -> GpuDirect:
    """Whether GPU memory could be registered with RDMA device `device` (None: the first one by
    name, as `lynx-sglang doctor` lists them): the device exists, and the peer-memory module is
    loaded or dma-buf registration is there. What is missing is the reason, not an error."""
    probes = probes or Probes()
    try:
        present = sorted(p.name for p in probes.infiniband.iterdir())
    except OSError:  # no such class: no RDMA stack in this kernel (or container)
        present = []
    if not present:
        return GpuDirect(False, None, f"no RDMA device in {probes.infiniband}")
    device = device or present[0]
    if device not in present:
        return GpuDirect(False, None, f"RDMA device {device} not found; present: "
                                      f"{', '.join(present)}")
    module = loaded_peer_mem_module(probes)
    if module is not None:
        return GpuDirect(True, module, f"kernel module {module} is loaded and RDMA device "
                                       f"{device} is present")
    why_not = _dma_buf(device, probes)
    if why_not is None:
        return GpuDirect(True, DMA_BUF, f"pyverbs has DmaBufMR and RDMA device {device} opens "
                                        "(not checked here: that its driver takes dma-buf "
                                        "memory, as mlx5 does and soft-RoCE does not, and that "
                                        "the GPU exports it: NVIDIA's open kernel modules)")
    return GpuDirect(False, None, f"on RDMA device {device} neither peer memory "
                                  f"({' nor '.join(PEER_MEM_MODULES)} loaded) nor dma-buf "
                                  f"({why_not})")
