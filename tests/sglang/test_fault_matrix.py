"""A sample of `lynx-sglang faults` cells through real SGLang servers (the whole matrix is one
documented command: `lynx-sglang faults`, docs/testing.md). Over the shaped link of two network
namespaces when run as root (as in CI), else on loopback, where the link faults are left out.

`LYNX_FAULTS_SAMPLE` (default 3) and `LYNX_FAULTS_SEED` (default 0) choose the cells, and
`LYNX_FAULTS_WINDOWED_SAMPLE` (default 1) those of a windowed matrix (`lynx-sglang faults
--windowed`: the faulted request goes in segments); every cell must be clean (see
`lynx_tools.faults.run` for what a cell checks).
"""

from __future__ import annotations

import os

import pytest

from lynx_tools.faults.cells import (
    NEXT_PROMPT_TOKENS,
    PROMPT_TOKENS,
    all_cells,
    select_cells,
    table,
    windowed_staging_mib,
)
from lynx_tools.faults.matrix import Matrix
from lynx_tools.measure import kv_dtype_server_args

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _run(sglang_model, pd_link, tmp_path, sample: int, windowed: bool) -> None:
    link = pd_link is not None
    cells = select_cells(all_cells(), sample=sample,
                         seed=int(os.environ.get("LYNX_FAULTS_SEED", "0")),
                         link=link, windowed=windowed)
    staging_mib = (windowed_staging_mib(sglang_model, "bfloat16", PROMPT_TOKENS,
                                        NEXT_PROMPT_TOKENS) if windowed else None)
    with Matrix(sglang_model, tmp_path, link=link, server_args=kv_dtype_server_args("bfloat16"),
                staging_mib=staging_mib) as matrix:
        results = [matrix.run_cell(cell) for cell in cells]
    print(table(results))
    assert all(r.clean for r in results), "\n".join(
        f"{r.cell}: {r.outcome}; {[k for k, v in r.checks.items() if not v]}; {r.details}"
        for r in results if not r.clean)


def test_sampled_fault_cells_lose_nothing(sglang_model, pd_link, tmp_path):
    _run(sglang_model, pd_link, tmp_path, int(os.environ.get("LYNX_FAULTS_SAMPLE", "3")),
         windowed=False)


def test_a_sampled_windowed_fault_cell_loses_nothing(sglang_model, pd_link, tmp_path):
    """The faulted request goes in segments through windows of staging (and says so: the cell's
    own check)."""
    _run(sglang_model, pd_link, tmp_path,
         int(os.environ.get("LYNX_FAULTS_WINDOWED_SAMPLE", "1")), windowed=True)
