"""`lynx_tools`: what an operator or developer runs beside SGLang — the `lynx-sglang` CLI, the CPU
demo, the benchmarks, the fault matrix, the load generator, the launcher, doctor and the studies.

Kept out of `lynx_sglang`, the package SGLang imports in every server process: the runtime never
imports this package (tests/test_layout.py checks the source, tests/sglang/test_pd_lynx.py a
running server), so a tool's dependencies and start-up cost never reach a server.
"""
