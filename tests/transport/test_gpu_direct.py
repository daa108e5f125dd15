"""GPUDirect RDMA detection (`lynx_transport.gpu_direct`) on a fake /sys, /proc/modules and
pyverbs: the peer-memory module seen either way, dma-buf only with `DmaBufMR` and a device that
opens, and a reason in every case."""

from __future__ import annotations

from types import SimpleNamespace

import fake_pyverbs
import pytest

from lynx_transport.gpu_direct import DMA_BUF, Probes, detect, loaded_peer_mem_module


class _ClosedDevice(fake_pyverbs.Context):
    def __init__(self, name: str):
        raise fake_pyverbs.PyverbsError(f"Failed to open device {name}")


def _pyverbs(dma_buf: bool = True, opens: bool = True):
    def load():
        return SimpleNamespace(Context=fake_pyverbs.Context if opens else _ClosedDevice,
                               PyverbsError=fake_pyverbs.PyverbsError,
                               DmaBufMR=object if dma_buf else None)
    return load


def _probes(tmp_path, devices=("mlx5_0",), sys_modules=(), proc_modules=(), pyverbs=None):
    """A fake /sys/module, /proc/modules and /sys/class/infiniband under `tmp_path`; pyverbs
    absent unless given."""
    for name in devices:
        (tmp_path / "infiniband" / name).mkdir(parents=True)
    for name in sys_modules:
        (tmp_path / "module" / name).mkdir(parents=True)
    (tmp_path / "modules").write_text("".join(f"{name} 86016 0 - Live 0x0000000000000000\n"
                                              for name in proc_modules))
    return Probes(sys_module=tmp_path / "module", proc_modules=tmp_path / "modules",
                  infiniband=tmp_path / "infiniband", pyverbs=pyverbs or (lambda: None))


@pytest.mark.parametrize("where", ["sys", "proc"])
@pytest.mark.parametrize("module", ["nvidia_peermem", "nv_peer_mem"])
def test_a_loaded_peer_memory_module_is_found_in_sys_or_proc(tmp_path, where, module):
    probes = _probes(tmp_path, sys_modules=[module] if where == "sys" else [],
                     proc_modules=[module] if where == "proc" else [])
    found = detect("mlx5_0", probes)
    assert (found.available, found.mechanism) == (True, module)
    assert module in found.reason and "mlx5_0" in found.reason
    assert found.summary().startswith(f"GPUDirect RDMA available ({module})")
    assert "still stages in host memory" in found.summary()


def test_the_drivers_module_wins_over_the_legacy_one(tmp_path):
    probes = _probes(tmp_path, sys_modules=["nv_peer_mem"], proc_modules=["nvidia_peermem"])
    assert loaded_peer_mem_module(probes) == "nvidia_peermem"


def test_a_missing_proc_modules_leaves_sys_module_to_decide(tmp_path):
    probes = _probes(tmp_path, sys_modules=["nvidia_peermem"])
    probes.proc_modules.unlink()
    assert detect(None, probes).mechanism == "nvidia_peermem"


def test_dma_buf_needs_dmabufmr_and_a_device_that_opens(tmp_path):
    found = detect("mlx5_0", _probes(tmp_path, pyverbs=_pyverbs()))
    assert (found.available, found.mechanism) == (True, DMA_BUF)
    assert "not checked here" in found.reason  # the driver's and the GPU's side

    old = detect("mlx5_0", _probes(tmp_path / "old", pyverbs=_pyverbs(dma_buf=False)))
    assert not old.available and old.mechanism is None
    assert "no DmaBufMR" in old.reason and "nvidia_peermem" in old.reason

    closed = detect("mlx5_0", _probes(tmp_path / "closed", pyverbs=_pyverbs(opens=False)))
    assert not closed.available and "does not open: Failed to open device mlx5_0" in closed.reason


def test_without_pyverbs_or_modules_it_is_host_staging_with_the_reason(tmp_path):
    found = detect("mlx5_0", _probes(tmp_path, proc_modules=["mlx5_ib", "ib_core"]))
    assert not found.available and "pyverbs is not importable" in found.reason
    assert found.summary() == f"verbs staging in host memory: {found.reason}"


def test_the_device_must_be_present(tmp_path):
    none = detect(None, _probes(tmp_path, devices=(), sys_modules=["nvidia_peermem"]))
    assert not none.available and "no RDMA device" in none.reason
    other = detect("mlx5_1", _probes(tmp_path / "b", sys_modules=["nvidia_peermem"]))
    assert not other.available and "mlx5_1 not found; present: mlx5_0" in other.reason
    first = detect(None, _probes(tmp_path / "c", devices=("mlx5_1", "mlx5_0"),
                                 sys_modules=["nvidia_peermem"]))
    assert first.available and "mlx5_0" in first.reason  # the first by name
