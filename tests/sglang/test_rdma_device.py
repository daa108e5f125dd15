"""Which RDMA device a Lynx rank drives: `--lynx-ib-device`, else SGLang's own
`--disaggregation-ib-device` resolved per GPU by SGLang's parser (list, per-GPU map, JSON file)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from lynx_sglang.errors import LynxConfigError

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (scripts/install.sh installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def rdma_device(sglang_in_process):
    from lynx_sglang.backend.transport_setup import rdma_device

    return rdma_device


def test_lynx_flag_wins_and_nothing_given_means_the_first_device(rdma_device):
    assert rdma_device("rxe0", "mlx5_0,mlx5_1", 1) == "rxe0"
    assert rdma_device(None, None, 3) is None
    assert rdma_device(None, "", 0) is None


def test_sglang_list_gives_each_gpu_its_own_nic(rdma_device):
    assert [rdma_device(None, "mlx5_0, mlx5_1", g) for g in range(4)] == [
        "mlx5_0", "mlx5_1", "mlx5_0", "mlx5_1"]


def test_sglang_per_gpu_map_and_json_file(rdma_device, tmp_path):
    mapping = '{"0": "mlx5_2", "1": "mlx5_3"}'
    assert rdma_device(None, mapping, 1) == "mlx5_3"
    path = tmp_path / "nics.json"
    path.write_text(json.dumps({"0": "mlx5_4", "1": "mlx5_5"}))
    assert rdma_device(None, str(path), 0) == "mlx5_4"
    with pytest.raises(LynxConfigError, match=r"disaggregation-ib-device.*GPU 7"):
        rdma_device(None, mapping, 7)
