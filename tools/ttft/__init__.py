"""`lynx-sglang bench-ttft`: its run (`bench`), clusters, clients, regimes (`--regime`), byte
bounds, results and report. `demo` and `bench-load` reuse its clusters, clients and results."""
