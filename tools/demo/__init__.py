"""`lynx-sglang demo` (`run`) and what it prints and writes (`report`), over bench-ttft's machinery."""
