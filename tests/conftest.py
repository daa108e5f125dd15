"""Suite-wide set-up: Triton kernels run in the interpreter wherever there is no CUDA device.

TRITON_INTERPRET must be set before any `triton.jit` function is defined, i.e. before
`lynx_kernels.ops_triton` (or SGLang, which imports Triton) is imported, hence here.
"""

import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
