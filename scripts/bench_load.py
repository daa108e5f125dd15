#!/usr/bin/env python3
"""PD cluster variants under Poisson arrivals (P50/P99 TTFT, time per output token, throughput,
SLO attainment per rate): `lynx-sglang bench-load` (see lynx_tools/load/bench.py).

    sudo .venv/bin/python scripts/bench_load.py --regime 1 --rates 0.05,0.1 --out out/bench_load
Writes <out>/bench_load.json and <out>/bench_load.png; about 3 minutes per rate and variant.
"""

import sys

from lynx_tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-load", *sys.argv[1:]]))
