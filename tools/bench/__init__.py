"""The benchmarks beside bench-ttft and bench-load: `lynx-sglang bench-transfer` (`transfer`, over the
link benchmarks of `link`, which scripts/bench_link.py runs too) and `lynx-sglang bench-verify`
(`verify`)."""
