"""The identity handshake that opens every prefill → decode transport session, both ends of it:
the prefill announces who it is and its wire settings as the empty request `IDENTITY_REQUEST`
(`introduce`, called by `backend.prefill.sessions.DecodeSessions`); the decode's accept thread
parses it (`Identity.parse`, `backend.decode.applier.DecodeApplier`) and answers accepted, or refused and
why (`answer`), on the same request id; the prefill reads that answer (`refusal`).

Messages (JSON in the announcement's meta):
  prefill → decode  {"rank_ip": str, "rank_port": int, "config": {wire settings},
                     "key": hex, "proof": hex}
  decode → prefill  {"accepted": true} | {"refused": why}
"key" and "proof" bind the claim to SGLang's bootstrap registration (`backend.rank_key`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from lynx_transport import Session, TransportError
from lynx_transport.types import MAX_REQUEST_ID

logger = logging.getLogger(__name__)

# Request id of the identity announcement: above SGLang's bootstrap rooms (< 2**63).
IDENTITY_REQUEST = MAX_REQUEST_ID
# The longest refusal reason sent (a decode names every differing flag).
MAX_REASON_CHARS = 1000
# Longer than any rank key or proof (hex).
MAX_PROOF_CHARS = 256


@dataclass(frozen=True)
class Identity:
    """A prefill rank as SGLang's control plane knows it (ip:port), its wire settings
    (`LynxConfig.wire_settings`; None if it sent none), and its rank key's public half with the
    proof for the decode it is announced to (hex; "" if it sent none: `backend.rank_key`)."""

    rank_ip: str
    rank_port: int
    settings: Any = None
    key: str = ""
    proof: str = ""

    @property
    def rank(self) -> tuple[str, int]:
        return self.rank_ip, self.rank_port

    def encode(self) -> bytes:
        return json.dumps({"rank_ip": self.rank_ip, "rank_port": self.rank_port,
                           "config": self.settings, "key": self.key,
                           "proof": self.proof}).encode()

    @classmethod
    def parse(cls, meta: bytes) -> Identity | None:
        """A prefill's announced identity, or None if malformed (untrusted peer input)."""
        try:
            who = json.loads(bytes(meta))
            ip, port = who["rank_ip"], who["rank_port"]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(ip, str) or not ip or len(ip) > 255:
            return None
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            return None
        key, proof = who.get("key", ""), who.get("proof", "")
        if not isinstance(key, str) or not isinstance(proof, str):
            return None
        # Longer ones are no key or proof (`rank_key.proven` checks them): keep no more.
        return cls(ip, port, who.get("config"), key[:MAX_PROOF_CHARS], proof[:MAX_PROOF_CHARS])


def introduce(session: Session, identity: Identity, timeout: float) -> str | None:
    """The prefill: announce `identity` on a newly opened session and wait (at most `timeout`)
    for the decode's answer; returns why it refused, or None if it accepted. Raises the
    transport's errors (no answer within `timeout`: `AnnouncementTimeoutError`)."""
    session.announce(IDENTITY_REQUEST, {}, meta=identity.encode())
    return refusal(session.wait_announcement(IDENTITY_REQUEST, timeout=timeout))


def refusal(answer) -> str | None:
    """Why the decode refused this prefill's session, from its answer to the identity
    announcement (`{"accepted": true}` or `{"refused": why}`); an answer that is neither is a
    refusal too."""
    try:
        said = json.loads(bytes(answer.meta))
    except ValueError:
        said = None
    if isinstance(said, dict) and said.get("accepted") is True:
        return None
    why = said.get("refused") if isinstance(said, dict) else None
    return why if isinstance(why, str) else f"unintelligible answer {bytes(answer.meta[:100])!r}"


def answer(session: Session, refused: str | None) -> None:
    """The decode: answer a prefill's identity announcement, accepted (`refused` None) or refused
    and why (the prefill waits for this answer when it opens a session, `introduce`)."""
    said = {"accepted": True} if refused is None else {"refused": refused[:MAX_REASON_CHARS]}
    try:
        session.announce(IDENTITY_REQUEST, {}, meta=json.dumps(said).encode())
    except (TransportError, ValueError) as exc:
        logger.debug("lynx: could not answer %s: %s", session.peer_address, exc)
