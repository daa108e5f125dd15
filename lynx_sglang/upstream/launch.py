"""SGLang's server launch as `python -m sglang.launch_server` does it: plugins loaded, the
arguments parsed, the server run, its child processes killed when it returns.

Called by `lynx_sglang.serve` (which activates `upstream.cpu_compat` first).
"""

from __future__ import annotations

import os


def launch_server(argv: list[str]) -> None:
    """Run an SGLang server with the command-line arguments `argv` until it exits."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
