"""Lynx's Prometheus metrics, exported through SGLang's own `/metrics` endpoint.

SGLang with `--enable-metrics` sets `PROMETHEUS_MULTIPROC_DIR` before it starts its scheduler
processes, and its HTTP server serves every process's metrics with prometheus_client's
multiprocess collector. Metrics created here, in a scheduler process, therefore appear on the same
`/metrics` page as SGLang's, with no endpoint of our own. Without `--enable-metrics` every record
call is a no-op.

Recorded by `lynx_sglang.backend.decode` (bytes and times of each request's two streams) and
`lynx_sglang.speculation.controller` (tokens speculated / accepted / rolled back, verification time, how
each speculating request ended).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Stages range from sub-millisecond (one layer's apply on a GPU) to the whole wire time.
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0)


@dataclass
class _Instruments:
    stream_bytes: Any
    anchor_wait: Any
    anchor_to_residual: Any
    spec_tokens: Any
    spec_requests: Any
    verify_seconds: Any
    stage_seconds: Any


_instruments: _Instruments | None = None
_disabled = False


def enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def _get() -> _Instruments | None:
    global _instruments, _disabled
    if _instruments is not None or _disabled:
        return _instruments
    if not enabled():
        _disabled = True
        return None
    # Imported only now: prometheus_client picks its multiprocess mode from the environment at
    # import time.
    from prometheus_client import Counter, Histogram

    _instruments = _Instruments(
        stream_bytes=Counter("lynx_stream_bytes_total",
                             "KV bytes received per Lynx stream (decode)", ["stream"]),
        anchor_wait=Histogram("lynx_anchor_wait_seconds",
                              "Transfer announced -> Anchor applied to the KV pool (decode)",
                              buckets=_TIME_BUCKETS),
        anchor_to_residual=Histogram("lynx_anchor_to_residual_seconds",
                                     "Anchor landed -> Residual applied (decode)",
                                     buckets=_TIME_BUCKETS),
        spec_tokens=Counter("lynx_spec_tokens_total",
                            "Speculative tokens on the Anchor by fate", ["fate"]),
        spec_requests=Counter("lynx_spec_requests_total",
                              "Requests decoded on the Anchor by outcome", ["outcome"]),
        verify_seconds=Histogram("lynx_spec_verify_seconds",
                                 "Verification forward + rollback per batch",
                                 buckets=_TIME_BUCKETS),
        stage_seconds=Histogram("lynx_stage_seconds",
                                "Duration of each traced stage of a request (lynx_sglang.trace)",
                                ["stage"], buckets=_STAGE_BUCKETS),
    )
    return _instruments


def record_transfer(anchor_bytes: int, residual_bytes: int, anchor_wait_s: float | None,
                    anchor_to_residual_s: float | None) -> None:
    m = _get()
    if m is None:
        return
    m.stream_bytes.labels("anchor").inc(anchor_bytes)
    m.stream_bytes.labels("residual").inc(residual_bytes)
    if anchor_wait_s is not None:
        m.anchor_wait.observe(anchor_wait_s)
    if anchor_to_residual_s is not None:
        m.anchor_to_residual.observe(anchor_to_residual_s)


def record_verification(speculated: int, accepted: int, outcome: str) -> None:
    """`outcome`: verified | not_speculable | aborted."""
    m = _get()
    if m is None:
        return
    m.spec_tokens.labels("speculated").inc(speculated)
    m.spec_tokens.labels("accepted").inc(accepted)
    m.spec_tokens.labels("rolled_back").inc(speculated - accepted)
    m.spec_requests.labels(outcome).inc()


def record_verify_time(seconds: float) -> None:
    m = _get()
    if m is not None:
        m.verify_seconds.observe(seconds)


def record_stage(stage: str, seconds: float) -> None:
    """One traced stage's duration (`lynx_sglang.trace.STAGES`)."""
    m = _get()
    if m is not None and seconds >= 0:
        m.stage_seconds.labels(stage).observe(seconds)
