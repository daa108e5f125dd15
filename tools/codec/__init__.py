"""`lynx-sglang codec-report` (`report`): its sample KV (`sample_kv`), measurements (`measure`) and
report schema (`schema`); scripts/exact_format_study.py reuses the first two."""
