"""The prefill's transport sessions, one per decode address (`DecodeSessions`): opened on first
use by whichever destination worker needs it (`open`), introduced with this prefill's identity
and wire settings (`backend.identity`), signed for that decode with this process's rank key
(`backend.rank_key`), and closed at once if the decode refuses them. After a
failed connect the address counts as unreachable for `UNREACHABLE_COOLDOWN_S`: rooms bound there
fail at once instead of each waiting out the connect timeout.

Owned by `backend.prefill.sender.PrefillSender`; called from its destination workers' threads
(`backend.prefill.worker`). A session lives until the endpoint closes, or the transport ends it on
the peer's death.
"""

from __future__ import annotations

import threading
import time

from lynx_transport import Endpoint, Session, SessionClosedError, TransportError

from ...config import LynxConfig
from ...errors import SettingsMismatchError
from ..identity import introduce
from ..rank_key import Claimant

# After a failed connect to a decode, rooms bound there fail at once for this long.
UNREACHABLE_COOLDOWN_S = 5.0


class DecodeSessions:
    """This prefill's sessions to its decodes (see the module). Thread-safe: `_lock` guards the
    maps and is never held while connecting, so one destination's connect never waits for
    another's."""

    def __init__(self, endpoint: Endpoint, claimant: Claimant, config: LynxConfig):
        self.endpoint = endpoint
        self.claimant = claimant
        self.config = config
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        # Decode addresses a connect failed to, with when they may be tried again.
        self._unreachable: dict[str, float] = {}

    def open(self, address: str) -> Session:
        """The session to the decode at `address`: the live one, or a new one once the decode
        has accepted this prefill's identity (each wait bounded by the connect timeout)."""
        with self._lock:
            s = self._sessions.get(address)
            if s is not None and not s.closed:
                return s
            retry_at = self._unreachable.get(address)
            if retry_at is not None and time.monotonic() < retry_at:
                raise SessionClosedError(
                    f"decode {address} was unreachable {UNREACHABLE_COOLDOWN_S:g} s ago or less "
                    f"(next try in {retry_at - time.monotonic():.1f} s)")
        # Connect outside the lock: another destination's worker must not wait for this one.
        s = None
        try:
            s = self.endpoint.connect(address, timeout=self.config.connect_timeout_s)
            why = introduce(s, self.claimant.claim(address, s.channel_binding),
                            self.config.connect_timeout_s)
        except TransportError as exc:
            if "TLS" in str(exc):
                # the transport's TLS refusals (mismatch, certificates, alerts) in the
                # operator's terms, the failure's kind kept
                exc = type(exc)(f"{exc}; prefill and decode need TLS alike: "
                                "--lynx-tls-cert/--lynx-tls-key/--lynx-tls-ca with "
                                "certificates of one CA, the decode's naming its address")
            if s is not None:
                # Connected but never answered (a stalled decode): nobody else holds this
                # session, so it would stay open, with its sockets, until the peer dies.
                s.close()
            with self._lock:
                self._unreachable[address] = time.monotonic() + UNREACHABLE_COOLDOWN_S
            raise exc from None
        if why is not None:
            s.close()
            raise SettingsMismatchError(f"decode {address} refused this prefill: {why}")
        with self._lock:
            self._unreachable.pop(address, None)
            self._sessions[address] = s
        return s
