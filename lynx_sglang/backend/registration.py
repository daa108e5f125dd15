"""Authenticated prefill registrations at SGLang's bootstrap server, and the lease that keeps a
registered rank's slot its own while it lives.

SGLang's bootstrap server takes any `PUT /route` and keeps the last row sent for a slot (its DP,
CP, TP and PP ranks): anyone who could reach it could re-register a live rank's ip:port with
another rank key (its rooms then fail: a denial of service) or, holding the transport secret as
well, put its own key there and serve the rank's rooms itself. Lynx's bootstrap server
(`backend.conn.LynxKVBootstrapServer`) therefore admits a row only through `RegistrationBook`:

- the row carries `FIELD` = {"time", "mac", "sig"}: an HMAC of the row and its time under the
  deployment's transport secret (a registration from someone without the secret changes
  nothing) and the Ed25519 signature of the same bytes with the rank key the row registers (it
  holds the key's private half);
- its time is within `MAX_SKEW_S` of the server's clock and later than the slot's current row's
  (a recorded registration replayed later does not bring an old key back);
- a slot whose holder is live, i.e. registered or renewed its lease within `LEASE_S`, takes no row
  with another rank or key: the holder renews (`PUT LEASE_PATH`, signed with its rank key, every
  `RENEW_EVERY_S`), a restarted rank (a new process, a new key) is accepted once the old lease has
  lapsed (SGLang's registration retries for ~15 s, more than `LEASE_S`).

Without a secret (loopback-only deployments) the MAC is not checked; signatures and leases are.

The prefill's side is `Registrar` (`backend.manager.LynxKVManager._register_topology_row` and its
lease thread); the book lives on the bootstrap server's event loop thread. Neither imports SGLang:
the row is SGLang's JSON dict, read here by the field names SGLang 0.5.21-0.5.23 send.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass

import requests

from .rank_key import BOOTSTRAP_FIELD, RankKey, signed_by, valid_key

logger = logging.getLogger(__name__)

FIELD = "lynx_registration"
LEASE_PATH = "/lynx/lease"
LEASE_S = 6.0  # a slot's holder is live this long after its last registration or renewal
RENEW_EVERY_S = 2.0
MAX_SKEW_S = 120.0  # registrations come from other nodes: their clocks may differ this much
# The row fields that name a slot (SGLang's bootstrap PUT).
SLOT_FIELDS = ("system_dp_rank", "attn_dp_rank", "attn_cp_rank", "attn_tp_rank", "pp_rank")
_REGISTRATION_LABEL = b"lynx-sglang bootstrap registration v1\0"
_LEASE_LABEL = b"lynx-sglang bootstrap lease v1\0"

Slot = tuple[int, ...]


def _canonical(label: bytes, body: dict, at: float) -> bytes:
    """The signed bytes of `body` (without `FIELD`) at time `at`: sorted keys, no spaces, so both
    ends compute them alike from the JSON."""
    fields = {k: v for k, v in body.items() if k != FIELD}
    return label + json.dumps([fields, at], sort_keys=True, separators=(",", ":")).encode()


def _mac(secret: bytes | None, message: bytes) -> str:
    return "" if secret is None else hmac.new(secret, message, hashlib.sha256).hexdigest()


def slot_of(row: dict) -> Slot | None:
    """The slot a row registers, or None if it names none (untrusted input)."""
    ranks = tuple(row.get(name) for name in SLOT_FIELDS)
    if all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 16 for r in ranks):
        return ranks
    return None


class Registrar:
    """The prefill's side: signs its rows and lease renewals with the secret and its rank key."""

    def __init__(self, secret: bytes | None, key: RankKey):
        self._secret = secret
        self._key = key

    def sign(self, row: dict) -> dict:
        """`row` with this rank's key and its registration proof (`FIELD`)."""
        row = {**row, BOOTSTRAP_FIELD: self._key.public}
        at = time.time()
        message = _canonical(_REGISTRATION_LABEL, row, at)
        return {**row, FIELD: {"time": at, "mac": _mac(self._secret, message),
                               "sig": self._key.sign_bytes(message)}}

    def lease(self, row: dict) -> dict:
        """The body of a lease renewal for registered `row`'s slot."""
        body = {"slot": list(slot_of(row) or ()), "key": self._key.public}
        at = time.time()
        return {**body, FIELD: {"time": at, "sig": self._key.sign_bytes(
            _canonical(_LEASE_LABEL, body, at))}}

    def keep_leases(self, rows: list[tuple[str, dict]], stop: threading.Event) -> None:
        """Renew the lease of each registered (registration URL, row) every `RENEW_EVERY_S` until
        `stop` (the prefill KV manager's thread). A failed renewal is logged when it starts
        failing and when it works again, not every time."""
        failing: dict[str, str] = {}
        while not stop.wait(RENEW_EVERY_S):
            for url, row in rows:
                lease_url = url.rsplit("/route", 1)[0] + LEASE_PATH
                try:
                    r = requests.put(lease_url, json=self.lease(row), timeout=RENEW_EVERY_S)
                    why = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
                except requests.RequestException as exc:
                    why = str(exc)
                if why is not None and url not in failing:
                    logger.warning("lynx: renewing this rank's bootstrap lease at %s failed (%s); "
                                   "another process may take its slot once it lapses", lease_url,
                                   why)
                elif why is None and url in failing:
                    logger.info("lynx: bootstrap lease at %s renewed again", lease_url)
                if why is None:
                    failing.pop(url, None)
                else:
                    failing[url] = why


@dataclass
class _Holder:
    rank: tuple[str, int]
    key: str
    at: float  # the holder's registration or renewal time, its clock (replays are older)
    seen: float  # when it last registered or renewed, this server's time.monotonic()


class RegistrationRefused(Exception):
    """A registration or renewal refused; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, why: str):
        super().__init__(why)
        self.status = status


class RegistrationBook:
    """The bootstrap server's side: which rank and key hold each slot, and since when (see the
    module docstring). Used on the server's one event loop thread."""

    def __init__(self, secret: bytes | None):
        self._secret = secret
        self._slots: dict[Slot, _Holder] = {}

    def key_of(self, rank: tuple[str, int]) -> str | None:
        """The rank key of the slot `rank` holds, if it holds one."""
        return next((h.key for h in self._slots.values() if h.rank == rank), None)

    def check(self, row: object, now: float | None = None) -> tuple[Slot, _Holder]:
        """The slot and holder a registration row would make; raises `RegistrationRefused` if it must not
        change anything. `record` it once SGLang has accepted the row."""
        now = time.monotonic() if now is None else now
        if not isinstance(row, dict):
            raise RegistrationRefused(400, "a registration is a JSON object")
        proof, slot = row.get(FIELD), slot_of(row)
        key = valid_key(row.get(BOOTSTRAP_FIELD))
        ip, port = row.get("rank_ip"), row.get("rank_port")
        if slot is None or not isinstance(ip, str) or not isinstance(port, int):
            raise RegistrationRefused(400, "the registration names no slot or rank")
        if not isinstance(proof, dict) or key is None:
            raise RegistrationRefused(403, "the registration is not signed by a Lynx prefill rank (no rank "
                               "key or proof): refused, nothing changed")
        at = self._fresh(proof.get("time"))
        message = _canonical(_REGISTRATION_LABEL, row, at)
        mac = proof.get("mac")
        if self._secret is not None and not (
                isinstance(mac, str) and hmac.compare_digest(mac, _mac(self._secret, message))):
            raise RegistrationRefused(403, "the registration is not authenticated with the deployment's "
                               "secret (--lynx-secret-file): refused, nothing changed")
        if not signed_by(key, message, proof.get("sig")):
            raise RegistrationRefused(403, "the registration is not signed with the rank key it registers")
        holder = _Holder((ip, port), key, at, now)
        current = self._slots.get(slot)
        if current is None:
            return slot, holder
        if (current.rank, current.key) == (holder.rank, holder.key):
            # The holder again: a newer row renews its lease; an older or equal one (SGLang's
            # retry of a PUT that did land, or a replay) changes nothing, not even the lease:
            # replaying a dead holder's row must not keep its slot from a restarted rank.
            return slot, holder if at > current.at else current
        if at <= current.at:
            raise RegistrationRefused(409, "the registration is not newer than the slot's current one (a "
                               "replay?): refused, nothing changed")
        live_for = LEASE_S - (now - current.seen)
        if live_for > 0:
            raise RegistrationRefused(409, f"slot {_name(slot)} is held by live prefill rank "
                               f"{current.rank[0]}:{current.rank[1]} with another key (its lease "
                               f"runs {live_for:.1f} s more; a restarted rank is accepted once it "
                               "lapses): refused, nothing changed")
        return slot, holder

    def record(self, slot: Slot, holder: _Holder) -> None:
        self._slots[slot] = holder

    def renew(self, body: object, now: float | None = None) -> None:
        """A holder's lease renewal (`Registrar.lease`); raises `RegistrationRefused` if it is not the live
        holder's."""
        now = time.monotonic() if now is None else now
        if not isinstance(body, dict) or not isinstance(body.get(FIELD), dict):
            raise RegistrationRefused(400, "a lease renewal is a JSON object with a proof")
        raw = body.get("slot")
        slot = tuple(raw) if isinstance(raw, list) else None
        holder = self._slots.get(slot) if slot is not None else None
        if holder is None or body.get("key") != holder.key:
            raise RegistrationRefused(409, "no such registration: register again")
        proof = body[FIELD]
        at = self._fresh(proof.get("time"))
        if not signed_by(holder.key, _canonical(_LEASE_LABEL, body, at), proof.get("sig")):
            raise RegistrationRefused(403, "the renewal is not signed with the slot's rank key")
        if at <= holder.at:
            raise RegistrationRefused(409, "the renewal is not newer than the last one (a replay?)")
        holder.at, holder.seen = at, now

    def _fresh(self, at: object) -> float:
        if not isinstance(at, (int, float)) or isinstance(at, bool) or abs(
                at - time.time()) > MAX_SKEW_S:
            raise RegistrationRefused(403, f"the proof's time is missing or more than {MAX_SKEW_S:g} s from "
                               "this server's clock")
        return float(at)


def _name(slot: Slot) -> str:
    return " ".join(f"{f}={r}" for f, r in zip(SLOT_FIELDS, slot, strict=True))
