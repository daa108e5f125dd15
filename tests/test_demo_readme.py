"""The demo quotes the README on the fast-link case (tools/demo/report.py): its words and its
measured figures must still be the README's, so that the demo and the README say the same."""

from __future__ import annotations

import re
from pathlib import Path

from lynx_tools.demo.report import FAST_LINK_MEASURED, FAST_LINK_WORDS

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_fast_link_words_are_the_readmes():
    assert FAST_LINK_WORDS in README


def test_the_quoted_fast_link_figures_are_in_the_readmes_table():
    row = next(ln for ln in README.splitlines() if ln.startswith("| 1 Gbit/s (R ≈ 0.06)"))
    for figure in re.findall(r"\d+\.\d+ s|paired \d\.\d+|[0-9a-f]{7}$", FAST_LINK_MEASURED):
        assert figure.replace(" s", "") in row, (figure, row)
