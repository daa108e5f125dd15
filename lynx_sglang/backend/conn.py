"""SGLang's per-request classes of the `lynx` transfer backend: `LynxKVSender` (prefill),
`LynxKVReceiver` (decode) and `LynxKVBootstrapServer`, on the SGLang classes that carry the
installed release's control plane (`upstream.adapter` picks them); each request's work goes to
the process's `backend.manager.LynxKVManager` (`kv_mgr`). SGLang finds them through
`get_kv_class`, hooked by `lynx_sglang.plugin`.

Lynx's field in SGLang's bootstrap protocol lives here too: the bootstrap server keeps the rank
key each prefill rank registers (`backend.rank_key.BOOTSTRAP_FIELD`) and answers it with the
rank's lookup; the receiver hands what its lookups found to the decode's `RankBindings`
(`backend.decode.bindings`), which asks again through `lookup_prefill_rank`."""

from __future__ import annotations

import json
import logging

import requests
from aiohttp import web

from ..config import LynxConfig
from ..errors import SettingsMismatchError
from ..failures import FailureKind, failure_kind_of
from ..upstream.kv_transfer import (
    BootstrapServerBase,
    KVPoll,
    KVReceiverBase,
    KVSenderBase,
    KVTransferMetric,
)
from .decode.bindings import BootstrapSlot, Registration
from .heads import check_tp_sizes
from .rank_key import BOOTSTRAP_FIELD, valid_key
from .registration import LEASE_PATH, RegistrationBook, RegistrationRefused

logger = logging.getLogger(__name__)


class LynxKVSender(KVSenderBase):
    """Prefill side of one request: SGLang's sender (CommonKVSender; MooncakeKVSender in releases
    where the Common one has no `send`/`poll`, `upstream.adapter`), whose `send` queues the
    request's KV indices on LynxKVManager.add_transfer_request (no CUDA host-index fast path)."""

    def get_transfer_metric(self) -> KVTransferMetric:
        # SGLang's own counts the pool bytes of the request's slots; report what Lynx moved
        # (the Anchor plus the coded Residual), so sglang:kv_transfer_total_mb and its speed
        # show the real wire volume.
        metric = super().get_transfer_metric()
        sent = self.kv_mgr.sender.take_sent_bytes(self.bootstrap_room)
        if sent is not None:
            metric.transfer_total_bytes = sent
        return metric


class LynxKVReceiver(KVReceiverBase):
    """Decode side of one request (on SGLang's CommonKVReceiver, or MooncakeKVReceiver where the
    Common one has no `send_metadata`/`failure_exception`: `upstream.adapter`): reserves and
    announces the request's staging range before SGLang sends its KV indices to the prefill;
    frees it on clear/abort. When staging is busy the KV indices wait here (`_held_metadata`),
    and `poll` sends them once the room got its range: until then the prefill does not start the
    request, and SGLang's waiting timeout has not started (it counts from the metadata; the
    applier bounds the wait for staging)."""

    _held_metadata: tuple | None = None

    def init(self, prefill_dp_rank: int):
        super().init(prefill_dp_rank)
        if self.conclude_state == KVPoll.Failed or not hasattr(self, "prefill_info"):
            return
        if self.kv_mgr.is_mla_backend:
            return  # every rank holds the whole latent: SGLang pairs any TP sizes with one source
        try:
            check_tp_sizes(self.prefill_info.attn_tp_size, self.kv_mgr.attn_tp_size)
        except SettingsMismatchError as exc:
            self._fail(str(exc), FailureKind.SETTINGS_MISMATCH)

    def _get_bootstrap_info_from_server(self, prefill_dp_rank, prefill_cp_rank, target_tp_rank,
                                        target_pp_rank):
        info = super()._get_bootstrap_info_from_server(prefill_dp_rank, prefill_cp_rank,
                                                       target_tp_rank, target_pp_rank)
        found = registration_of(info)
        if found is not None:
            # Recorded before SGLang sends the rank anything: its sessions are checked against it.
            slot = BootstrapSlot(self.bootstrap_addr, int(prefill_dp_rank), int(prefill_cp_rank),
                                 int(target_tp_rank), int(target_pp_rank))
            self.kv_mgr.applier.bindings.record(slot, found)
        return info

    def _fail(self, reason: str, kind: FailureKind) -> None:
        self.kv_mgr.lynx_runtime.recorder.metrics.record_failure(kind)
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


class LynxKVBootstrapServer(BootstrapServerBase):
    """SGLang's HTTP bootstrap registry, admitting only registrations authenticated with the
    deployment's secret and signed with the rank key they register, never another key for a live
    rank's slot (`backend.registration.RegistrationBook`); it adds the rank key to the answer of
    that rank's lookup and takes the holders' lease renewals (`PUT registration.LEASE_PATH`). Its
    handlers all run on the server's one event loop thread."""

    def __init__(self, host: str, port: int):
        # Before SGLang's constructor, which starts serving. The secret comes with the Lynx
        # config SGLang's launcher process exported (`plugin`).
        config = LynxConfig.from_env() or LynxConfig()
        secret = config.load_secret()
        if secret is None:
            logger.warning("lynx: bootstrap registrations are not authenticated (no "
                           "--lynx-secret-file): only their rank-key signatures and leases are "
                           "checked")
        self._book = RegistrationBook(secret)
        super().__init__(host, port)

    def _setup_routes(self):
        super()._setup_routes()
        self.app.router.add_route("PUT", LEASE_PATH, self._handle_lease)

    async def _handle_route_put(self, request: web.Request):
        try:
            row = await request.json()
            slot, holder = self._book.check(row)
        except RegistrationRefused as refused:
            logger.warning("lynx: bootstrap registration from %s refused: %s", request.remote,
                           refused)
            return web.Response(text=str(refused), status=refused.status)
        except ValueError:
            return web.Response(text="the registration is no JSON", status=400)
        response = await super()._handle_route_put(request)  # aiohttp keeps the body read
        if response.status == 200:
            self._book.record(slot, holder)
        return response

    async def _handle_lease(self, request: web.Request):
        try:
            self._book.renew(await request.json())
        except RegistrationRefused as refused:
            return web.Response(text=str(refused), status=refused.status)
        except ValueError:
            return web.Response(text="the renewal is no JSON", status=400)
        return web.Response(text="OK", status=200)

    async def _handle_route_get(self, request: web.Request):
        response = await super()._handle_route_get(request)
        if response.status != 200:
            return response
        info = json.loads(response.text)
        key = self._book.key_of((info.get("rank_ip"), info.get("rank_port")))
        if key is None:  # the server's own parameters, or a rank that registered no key
            return response
        return web.json_response({**info, BOOTSTRAP_FIELD: key}, status=200)


def registration_of(info: object) -> Registration | None:
    """The rank and rank key of a bootstrap server's answer to a rank lookup; None if it names no
    rank."""
    if not isinstance(info, dict):
        return None
    ip, port = info.get("rank_ip"), info.get("rank_port")
    if not isinstance(ip, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    return Registration((ip, port), valid_key(info.get(BOOTSTRAP_FIELD)))


def lookup_prefill_rank(slot: BootstrapSlot, timeout: float) -> Registration:
    """What SGLang's bootstrap server lists at `slot` now (the `/route` lookup SGLang's receiver
    makes), each of connecting and reading bounded by `timeout`; raises when it answers nothing
    usable."""
    response = requests.get(
        f"http://{slot.bootstrap_addr}/route?prefill_dp_rank={slot.dp_rank}"
        f"&prefill_cp_rank={slot.cp_rank}&target_tp_rank={slot.tp_rank}"
        f"&target_pp_rank={slot.pp_rank}", timeout=timeout)
    if response.status_code != 200:
        raise LookupError(f"HTTP {response.status_code}: {response.text[:200]}")
    found = registration_of(response.json())
    if found is None:
        raise LookupError(f"an answer naming no rank: {response.text[:200]}")
    return found
