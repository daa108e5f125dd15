"""A small round of `lynx-sglang load` through real SGLang servers: 12 concurrent requests (each
prompt length of the mix once, some abandoned by their client mid-stream) over 2 prefills and 1
decode behind the router, with staging for only a few of them at a time (`STAGING_MIB`), so that
requests queue for it on both sides. Every completed greedy output must equal the single
server's, and the decode's KV slots and every server's staging must be back to idle. The 64- and
256-request rounds and the soak are commands (docs/testing.md)."""

from __future__ import annotations

import pytest

from lynx_sglang.names import STAGING_QUEUED_LOG
from lynx_tools.load.run import PROMPT_LENGTHS, run_load
from lynx_tools.measure import kv_dtype_server_args

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# The round's prompts hold ~250 MiB of staging together (SmolLM2, exact target: 29.7 KB a token);
# 64 MiB holds the longest one, or a few short ones, at a time.
STAGING_MIB = 64


def test_concurrent_requests_over_two_prefills_are_exact_and_leave_nothing(sglang_model,
                                                                          tmp_path):
    [report] = run_load(sglang_model, requests_per_round=len(PROMPT_LENGTHS), prefills=2,
                        abandon=0.25, duration_s=0.0, transfer_backend="lynx", seed=1,
                        timeout_s=600.0,
                        server_args=(*kv_dtype_server_args("bfloat16"),
                                     "--lynx-staging-mib", str(STAGING_MIB)),
                        run_dir=tmp_path)
    assert report.abandoned and report.completed == report.requests - report.abandoned
    assert report.clean, report
    # Requests did queue for the decode's staging (none failed for it: all completed above).
    decode_log = (tmp_path / "pd" / "decode.log").read_text(errors="replace")
    assert STAGING_QUEUED_LOG in decode_log
