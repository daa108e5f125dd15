"""SGLang's per-request classes of the `lynx` transfer backend: `LynxKVSender` (prefill),
`LynxKVReceiver` (decode) and `LynxKVBootstrapServer`, on SGLang's Common* classes; each request's
work goes to the process's `backend.manager.LynxKVManager` (`kv_mgr`). SGLang finds them through
`get_kv_class`, hooked by `lynx_sglang.plugin`."""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVReceiver,
    CommonKVSender,
)

from .. import metrics
from ..failures import FailureKind, failure_kind_of

logger = logging.getLogger(__name__)


class LynxKVSender(CommonKVSender):
    """Prefill side of one request: SGLang's CommonKVSender, whose `send` queues the request's
    KV indices on LynxKVManager.add_transfer_request (no CUDA host-index fast path)."""

    def get_transfer_metric(self) -> KVTransferMetric:
        # SGLang's own counts the pool bytes of the request's slots; report what Lynx moved
        # (the Anchor plus the coded Residual), so sglang:kv_transfer_total_mb and its speed
        # show the real wire volume.
        metric = super().get_transfer_metric()
        sent = self.kv_mgr.sender.take_sent_bytes(self.bootstrap_room)
        if sent is not None:
            metric.transfer_total_bytes = sent
        return metric


class LynxKVReceiver(CommonKVReceiver):
    """Decode side of one request: reserves and announces the request's staging range before
    SGLang sends its KV indices to the prefill; frees it on clear/abort. When staging is busy the
    KV indices wait here (`_held_metadata`), and `poll` sends them once the room got its range:
    until then the prefill does not start the request, and SGLang's waiting timeout has not
    started (it counts from the metadata; the applier bounds the wait for staging)."""

    _held_metadata: tuple | None = None

    def init(self, prefill_dp_rank: int):
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or not hasattr(self, "prefill_info"):
            return
        if self.prefill_info.attn_tp_size != self.kv_mgr.attn_tp_size:
            self._fail(f"lynx needs equal attention TP sizes on prefill "
                       f"({self.prefill_info.attn_tp_size}) and decode "
                       f"({self.kv_mgr.attn_tp_size})", FailureKind.SETTINGS_MISMATCH)

    def _fail(self, reason: str, kind: FailureKind) -> None:
        metrics.record_failure(kind)
        self.kv_mgr.report_status(self.bootstrap_room, reason)
        self.conclude_state = KVPoll.Failed
        # Tell the prefill now: it would otherwise wait for metadata that never comes (SGLang's
        # bootstrap timeout, 300 s by default).
        self.ensure_abort_notified()

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None,
                      decode_prefix_len=None, destination=None, device_kv_indices=None):
        if self.conclude_state == KVPoll.Failed or getattr(self, "bootstrap_infos", None) is None:
            return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
        if decode_prefix_len:
            self._fail("lynx does not support a decode-side prefix cache",
                       FailureKind.SETTINGS_MISMATCH)
            return None
        kwargs = {} if destination is None else {"destination": destination}
        args = (kv_indices, aux_index, state_indices, decode_prefix_len, device_kv_indices, kwargs)
        try:
            staged = self.kv_mgr.register_rx_room(self, kv_indices, aux_index)
        except Exception as exc:
            self._prepare_failed(exc)
            return None
        if not staged:
            self._held_metadata = args
            return None
        return self._send_metadata(args)

    def _send_metadata(self, args: tuple):
        kv_indices, aux_index, state_indices, decode_prefix_len, device_kv_indices, kwargs = args
        return super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len,
                                     device_kv_indices=device_kv_indices, **kwargs)

    def _prepare_failed(self, exc: Exception) -> None:
        logger.error("lynx: room %s: %s", self.bootstrap_room, exc)
        self._fail(f"lynx decode could not prepare the transfer: {exc}", failure_kind_of(exc))

    def poll(self):
        if self._held_metadata is not None and self.conclude_state is None:
            try:
                staged = self.kv_mgr.applier.staged(self.bootstrap_room)
            except Exception as exc:
                self._held_metadata = None
                self._prepare_failed(exc)
                return self.conclude_state
            if staged:
                args, self._held_metadata = self._held_metadata, None
                self._send_metadata(args)
        return super().poll()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.applier.drop(self.bootstrap_room, keep_speculative=True)

    def abort(self):
        super().abort()
        self.kv_mgr.applier.drop(self.bootstrap_room)
        self.kv_mgr.forget_own_failure(self.bootstrap_room)

    def failure_exception(self):
        # SGLang pops the room's failure record in there; the own reason stays authoritative
        # until then (a prefill status arriving meanwhile must not replace it).
        try:
            super().failure_exception()
        finally:
            self.kv_mgr.forget_own_failure(self.bootstrap_room)


class LynxKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap registry, unchanged."""
