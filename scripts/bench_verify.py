#!/usr/bin/env python3
"""What one verification forward costs, in ordinary decode steps of the same request, per
speculation depth, through a real SGLang PD cluster: `lynx-sglang bench-verify` (see
tools/bench/verify.py).

    .venv/bin/python scripts/bench_verify.py --out out/bench_verify
Writes <out>/bench_verify.json and prints a table; about two minutes per depth on 2 cores.
"""

import sys

from lynx_tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-verify", *sys.argv[1:]]))
