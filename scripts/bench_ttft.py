#!/usr/bin/env python3
"""TTFT of PD cluster variants (mooncake_tcp, Lynx exact, Lynx int8) on one shaped link, driven by
SGLang's own `sglang.bench_serving`: `lynx-sglang bench-ttft` (see lynx_sglang/bench_ttft.py).

    sudo .venv/bin/python scripts/bench_ttft.py --out out/bench_ttft              # 1 Gbit/s
    sudo .venv/bin/python scripts/bench_ttft.py --link 10mbit --out out/bench_ttft_10mbit
Writes <out>/bench_ttft.json and <out>/bench_ttft.png; a few minutes per variant on 2 cores.
"""

import sys

from lynx_tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-ttft", *sys.argv[1:]]))
