"""`python -m lynx_sglang.serve [SGLang server arguments]`: SGLang's `launch_server`, with Lynx's CPU
compatibility active from interpreter start in every process of the server.

Why a module of its own: on a machine without CUDA, SGLang's scheduler process imports
`sgl_kernel` and `torchvision` while its module loads, before it calls `load_plugins()` - so the
plugin is too late there. SGLang starts that process with multiprocessing's "spawn" method, whose
child re-imports the parent's main module by name (as `__mp_main__`) before it unpickles its
target. Started as `python -m lynx_sglang.serve`, that main module is this one, so the activation
below runs first in the launcher and in every spawned process. (No `sitecustomize`/`.pth` is
installed: nothing changes for other Python programs.)

With a CUDA device this is exactly `python -m sglang.launch_server` (nothing is activated).
Used by the launcher (`lynx-sglang up`); users may run it directly.
"""

from __future__ import annotations

import os
import sys

from lynx_sglang.upstream import cpu_compat
from lynx_sglang.upstream.launch import launch_server

if not os.environ.get(cpu_compat.CPU_ENGINE_ENV) and not cpu_compat.cuda_device_present():
    # SGLang cannot serve on a CUDA-less box without its CPU engine; select it unless the user
    # decided otherwise.
    os.environ[cpu_compat.CPU_ENGINE_ENV] = "1"
cpu_compat.activate()


def main(argv: list[str] | None = None) -> int:
    launch_server(sys.argv[1:] if argv is None else argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
