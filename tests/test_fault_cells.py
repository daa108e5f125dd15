"""`lynx_sglang.tools.faults`: the matrix's cells, what runs where and the sampled subset (no
servers; tests/sglang/test_fault_matrix.py runs cells)."""

from __future__ import annotations

from lynx_sglang.tools.faults import (
    FAULTS,
    MODES,
    PHASES,
    TARGETS,
    Cell,
    CellResult,
    all_cells,
    select_cells,
    table,
)


def test_the_matrix_is_every_combination_of_its_axes():
    cells = all_cells()
    assert len(cells) == len(set(cells)) == len(TARGETS) * len(FAULTS) * len(PHASES) * len(MODES)


def test_link_cells_are_left_out_without_a_shaped_link():
    assert Cell("decode", "partition", "between", "greedy").unsupported(link=False)
    assert Cell("prefill", "sigkill", "mid-residual", "greedy").unsupported(link=False)
    assert Cell("prefill", "sigkill", "between", "greedy").unsupported(link=False) is None
    assert Cell("decode", "rst", "mid-residual", "sampled").unsupported(link=True) is None
    sample = select_cells(all_cells(), sample=50, seed=1, link=False)
    assert sample and all(c.unsupported(False) is None for c in sample)


def test_a_sample_covers_each_target_and_fault_before_repeating_and_depends_on_the_seed():
    four = select_cells(all_cells(), sample=4, seed=7, link=False)
    assert len({(c.target, c.fault) for c in four}) == 4
    ten = select_cells(all_cells(), sample=10, seed=7, link=True)
    assert {(c.target, c.fault) for c in ten} == {(t, f) for t in TARGETS for f in FAULTS}
    assert select_cells(all_cells(), sample=10, seed=7, link=True) == ten
    assert select_cells(all_cells(), sample=10, seed=8, link=True) != ten


def test_axes_filter_and_the_table_names_every_failed_check():
    only = select_cells(all_cells(), targets=("decode",), faults=("sigstop",),
                        phases=("between",), modes=("greedy", "sampled"))
    assert [c.name for c in only] == ["decode/sigstop/between/greedy",
                                      "decode/sigstop/between/sampled"]
    bad = CellResult("decode/sigstop/between/greedy", outcome="hung",
                     checks={"client answered or failed within the deadline": False,
                             "no staging held": True})
    skipped = CellResult("decode/rst/between/greedy", skipped="needs the shaped link")
    assert not bad.clean and skipped.clean
    text = table([bad, skipped])
    assert "FAIL: client answered or failed within the deadline" in text
    assert "skipped: needs the shaped link" in text
