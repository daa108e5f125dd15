"""The C codec is optional for the package but not for this project's installs: where a C compiler
exists (every CI box and the README's set-up), a missing `lynx_kernels._ckernels` means the build
broke and `impl="auto"` silently fell back to the torch reference, so this fails instead of the
fused tests skipping."""

from __future__ import annotations

import shutil

import pytest

from lynx_kernels import ops_cpu


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler on this machine: the torch fallback is expected")
def test_the_c_kernels_are_built_where_a_compiler_exists():
    assert ops_cpu.available(), ops_cpu.unavailable_reason()
    assert ops_cpu.isa() in ("x86-64-v4", "x86-64-v3", "baseline")
