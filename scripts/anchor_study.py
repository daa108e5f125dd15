#!/usr/bin/env python3
"""Anchor quality study on the embedded model: `lynx-sglang anchor-study` (see lynx_sglang/anchor_study.py).

Quick smoke run (< 2 min): scripts/anchor_study.py --prompts 2 --tokens 8 --min-len 300 --max-len 400
Full run in the background:
  nohup .venv/bin/python scripts/anchor_study.py --resume > out/anchor_study.log 2>&1 &
Writes out/anchor_study.json (after every prompt) and out/anchor_study.png.
"""

import sys

from lynx_tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["anchor-study", *sys.argv[1:]]))
