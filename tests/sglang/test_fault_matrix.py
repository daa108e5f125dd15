"""A sample of `lynx-sglang faults` cells through real SGLang servers (the whole matrix is one
documented command: `lynx-sglang faults`, docs/testing.md). Over the shaped link of two network
namespaces when run as root (as in CI), else on loopback, where the link faults are left out.

`LYNX_FAULTS_SAMPLE` (default 3) and `LYNX_FAULTS_SEED` (default 0) choose the cells; every cell
must be clean (see `lynx_sglang.tools.faults` for what a cell checks).
"""

from __future__ import annotations

import os

import pytest

from lynx_sglang.tools.faults import Matrix, all_cells, select_cells, table
from lynx_sglang.tools.measure import kv_dtype_server_args

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_sampled_fault_cells_lose_nothing(sglang_model, pd_link, tmp_path):
    cells = select_cells(all_cells(), sample=int(os.environ.get("LYNX_FAULTS_SAMPLE", "3")),
                         seed=int(os.environ.get("LYNX_FAULTS_SEED", "0")),
                         link=pd_link is not None)
    with Matrix(sglang_model, tmp_path, link=pd_link is not None,
                server_args=kv_dtype_server_args("bfloat16")) as matrix:
        results = [matrix.run_cell(cell) for cell in cells]
    print(table(results))
    assert all(r.clean for r in results), "\n".join(
        f"{r.cell}: {r.outcome}; {[k for k, v in r.checks.items() if not v]}; {r.details}"
        for r in results if not r.clean)
