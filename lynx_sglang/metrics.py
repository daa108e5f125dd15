"""Lynx's Prometheus metrics, exported through SGLang's own `/metrics` endpoint.

SGLang with `--enable-metrics` sets `PROMETHEUS_MULTIPROC_DIR` before it starts its scheduler
processes, and its HTTP server serves every process's metrics with prometheus_client's
multiprocess collector. Metrics created here, in a scheduler process, therefore appear on the same
`/metrics` page as SGLang's, with no endpoint of our own. Without `--enable-metrics` every record
call is a no-op.

Recorded by `lynx_sglang.backend.decode.report` (bytes and times of each request's two streams, failed
requests), `lynx_sglang.backend.prefill.worker` (failed sends), `lynx_sglang.backend.staging` (staging
memory in use) and `lynx_sglang.speculation.controller` (tokens speculated / accepted / rolled back,
verification time, how each speculating request ended), and `lynx_sglang.idle` (the sizes of the
per-request maps, about once a second), each through the `Metrics` of its process's
`recorder.Recorder`. Every series carries SGLang's `model_name` plus the server's `role`
(prefill/decode) and `tp_rank`: the fields of that `Metrics`, built once per scheduler process by
the KV manager.

The Prometheus instruments themselves are made once per process and cached at module level
(`_get`): prometheus_client's registry is process-wide and refuses a second instrument of one
name, so they follow its convention rather than living on an object.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the runtime import would pull torch into every tool that records nothing
    from .failures import FailureKind

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Stages range from sub-millisecond (one layer's apply on a GPU) to the whole wire time.
_STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0)


@dataclass
class _Instruments:
    failures: Any
    staging_used: Any
    stream_bytes: Any
    anchor_bits: Any
    anchor_wait: Any
    anchor_to_residual: Any
    spec_tokens: Any
    spec_requests: Any
    verify_seconds: Any
    stage_seconds: Any
    tracked: Any
    listener: Any


# The label names every series starts with, in the order `Metrics._labels` gives their values.
_PROCESS_LABELS = ("model_name", "role", "tp_rank")


def enabled() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


# Module-level on purpose, once per process: prometheus_client's registry is process-wide (see the
# module), unlike the labels, which each `Metrics` carries.
@functools.cache
def _get() -> _Instruments | None:
    """This process's instruments, made at the first record (None without --enable-metrics).
    Once per process, as Prometheus wants: its registry is process-wide and refuses a second
    instrument of one name."""
    if not enabled():
        return None
    # Imported only now: prometheus_client picks its multiprocess mode from the environment at
    # import time.
    from prometheus_client import Counter, Gauge, Histogram

    p = list(_PROCESS_LABELS)
    return _Instruments(
        failures=Counter("lynx_request_failures_total",
                         "Requests whose Lynx transfer failed, by kind of reason", [*p, "kind"]),
        staging_used=Gauge("lynx_staging_used_bytes", "Staging memory held by requests in flight",
                           p, multiprocess_mode="livesum"),
        stream_bytes=Counter("lynx_stream_bytes_total",
                             "KV bytes received per Lynx stream (decode)", [*p, "stream"]),
        anchor_bits=Counter("lynx_anchor_bits_requests_total",
                            "Requests received by the width of their Anchor (decode; "
                            "--lynx-anchor-width)", [*p, "bits"]),
        anchor_wait=Histogram("lynx_anchor_wait_seconds",
                              "Transfer announced -> Anchor applied to the KV pool (decode)",
                              p, buckets=_TIME_BUCKETS),
        anchor_to_residual=Histogram("lynx_anchor_to_residual_seconds",
                                     "Anchor landed -> Residual applied (decode)",
                                     p, buckets=_TIME_BUCKETS),
        spec_tokens=Counter("lynx_spec_tokens_total",
                            "Speculative tokens on the Anchor by fate", [*p, "fate"]),
        spec_requests=Counter("lynx_spec_requests_total",
                              "Requests decoded on the Anchor by outcome", [*p, "outcome"]),
        verify_seconds=Histogram("lynx_spec_verify_seconds",
                                 "Verification forward + rollback per batch",
                                 p, buckets=_TIME_BUCKETS),
        stage_seconds=Histogram("lynx_stage_seconds",
                                "Duration of each traced stage of a request (lynx_sglang.trace)",
                                [*p, "stage"], buckets=_STAGE_BUCKETS),
        tracked=Gauge("lynx_tracked_requests",
                      "Entries of Lynx's per-request maps (0 on an idle server; see lynx_sglang.idle)",
                      [*p, "map"], multiprocess_mode="livesum"),
        listener=Gauge("lynx_tcp_listener_events",
                       "The tcp data listener's events since start-up: listener_restarts (its "
                       "accept loop failed and was restarted), connection_errors, "
                       "preambles_evicted / _expired / _refused, accept_failed, "
                       "tls_handshakes_failed", [*p, "event"], multiprocess_mode="livesum"),
    )


@dataclass(frozen=True)
class Metrics:
    """Records this scheduler process's series, each labelled with the process's identity (SGLang's
    `model_name`, the server's `role`, its `tp_rank`). Built once per process by the KV manager (the
    defaults where another backend's scheduler records: `recorder.Recorder.for_process`), held in
    its `recorder.Recorder`, and called by the components that record."""

    model_name: str = ""
    role: str = ""
    tp_rank: int = 0

    def _labels(self, metric, *own: str):
        return metric.labels(self.model_name, self.role, str(self.tp_rank), *own)

    def record_transfer(self, anchor_bytes: int, residual_bytes: int,
                        anchor_wait_s: float | None, anchor_to_residual_s: float | None,
                        anchor_bits: int) -> None:
        m = _get()
        if m is None:
            return
        self._labels(m.anchor_bits, str(anchor_bits)).inc()
        self._labels(m.stream_bytes, "anchor").inc(anchor_bytes)
        self._labels(m.stream_bytes, "residual").inc(residual_bytes)
        if anchor_wait_s is not None:
            self._labels(m.anchor_wait).observe(anchor_wait_s)
        if anchor_to_residual_s is not None:
            self._labels(m.anchor_to_residual).observe(anchor_to_residual_s)

    def record_verification(self, speculated: int, accepted: int, outcome: str) -> None:
        """`outcome`: verified | not_speculable | aborted."""
        m = _get()
        if m is None:
            return
        self._labels(m.spec_tokens, "speculated").inc(speculated)
        self._labels(m.spec_tokens, "accepted").inc(accepted)
        self._labels(m.spec_tokens, "rolled_back").inc(speculated - accepted)
        self._labels(m.spec_requests, outcome).inc()

    def record_verify_time(self, seconds: float) -> None:
        m = _get()
        if m is not None:
            self._labels(m.verify_seconds).observe(seconds)

    def record_stage(self, stage: str, seconds: float) -> None:
        """One traced stage's duration (`lynx_sglang.trace.STAGES`)."""
        m = _get()
        if m is not None and seconds >= 0:
            self._labels(m.stage_seconds, stage).observe(seconds)

    def record_failure(self, kind: FailureKind) -> None:
        """One request whose transfer failed on this server, by kind (`failures.FailureKind`)."""
        m = _get()
        if m is not None:
            self._labels(m.failures, kind.value).inc()

    def record_tracked(self, sizes: dict[str, int]) -> None:
        """How many requests each per-request map of this process holds (leak checks)."""
        m = _get()
        if m is not None:
            for name, size in sizes.items():
                self._labels(m.tracked, name).set(size)

    def record_listener(self, counters: dict[str, int]) -> None:
        """The tcp data listener's event counts (`lynx_transport.tcp_accept.DataListener`)."""
        m = _get()
        if m is not None:
            for event, n in counters.items():
                self._labels(m.listener, event).set(n)

    def record_staging_used(self, used_bytes: int) -> None:
        m = _get()
        if m is not None:
            self._labels(m.staging_used).set(used_bytes)
