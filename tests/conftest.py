"""Suite-wide set-up: Triton kernels run in the interpreter wherever there is no CUDA device.

TRITON_INTERPRET must be set before any `triton.jit` function is defined, i.e. before
`lynx_kernels.ops_triton` (or SGLang, which imports Triton) is imported, hence here.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Sampled CI runs (tests/ci_sample.py): pytest finds these hooks by name in this module.
from ci_sample import pytest_collection_modifyitems, pytest_report_header  # noqa: F401
