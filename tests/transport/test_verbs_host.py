"""Host-side checks of the `verbs` backend that need no RDMA device: option validation and the
clear errors when pyverbs or a device is missing. (Data-path tests: test_verbs.py, in the guest.)"""

from __future__ import annotations

import sys

import pytest

from lynx_transport import BackendUnavailableError, Endpoint
from lynx_transport.verbs import VerbsOptions, _import_pyverbs


def test_options_validated():
    assert VerbsOptions.from_dict({}) == VerbsOptions()
    opts = VerbsOptions.from_dict({"device": "mlx5_0", "gid_index": 3, "anchor_sl": 5})
    assert (opts.device, opts.gid_index, opts.anchor_sl) == ("mlx5_0", 3, 5)
    with pytest.raises(ValueError, match="unknown verbs backend option"):
        VerbsOptions.from_dict({"ib_device": "mlx5_0"})
    for bad in ({"anchor_sl": 16}, {"residual_tc": 256}, {"max_outstanding": 0},
                {"retry_cnt": 8}, {"ack_timeout": 32}, {"keepalive_s": 0},
                {"path_mtu": 1500}, {"gid_index": -1}):
        with pytest.raises(ValueError):
            VerbsOptions.from_dict(bad)


def test_unknown_option_refused_by_endpoint():
    with pytest.raises(ValueError, match="unknown verbs backend option"):
        Endpoint(backend="verbs", backend_options={"nope": 1})


def test_missing_pyverbs_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs.enums", None)  # makes `import pyverbs.enums` fail
    with pytest.raises(BackendUnavailableError, match="python3-pyverbs"):
        _import_pyverbs()
    with pytest.raises(BackendUnavailableError, match="python3-pyverbs"):
        Endpoint(backend="verbs")


def _has_rdma_device() -> bool:
    try:
        from pyverbs.device import get_device_list

        return bool(get_device_list())
    except Exception:
        return False


@pytest.mark.skipif(_has_rdma_device(), reason="this machine has an RDMA device")
def test_no_device_is_a_clear_error():
    pytest.importorskip("pyverbs.device", reason="pyverbs not installed")
    with pytest.raises(BackendUnavailableError, match="no RDMA device"):
        Endpoint(backend="verbs")
