"""A prefill rank's proof that it is the rank SGLang's bootstrap server registered: the rank key.

Every prefill process makes a fresh Ed25519 key pair (`RankKey`) before it registers with SGLang's
bootstrap server, and registers the public half beside its rank ip:port (`BOOTSTRAP_FIELD`;
`backend.manager.LynxKVManager._register_topology_row`, stored and served by
`backend.conn.LynxKVBootstrapServer`). Each session it opens to a decode claims its rank with that
key and a signature (`Claimant.claim`) over the rank, the decode address it dialed and the
session's channel binding (`lynx_transport.Session.channel_binding`, from both ends' handshake
nonces): a proof made for one decode is worth nothing at another (a peer that got a prefill to dial
it cannot pass the prefill's proof on), and a proof seen once is worth nothing on any other session
(a secret holder who recorded a real claim cannot replay it after the real rank's session ends).
The decode checks the signature against its own side of the session (`proven`,
`backend.decode.sessions`) and then that the key is the one the bootstrap server lists for that
rank (`backend.decode.bindings`).

The shared transport secret cannot tell one holder from another; the private key never leaves the
prefill process, so a peer that holds the secret still cannot claim a rank it is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .identity import Identity

# The field of SGLang's bootstrap registration (and of its answer to a rank lookup) that carries
# the rank key's public half, as hex.
BOOTSTRAP_FIELD = "lynx_rank_key"
KEY_HEX_CHARS = 64  # an Ed25519 public key: 32 bytes
PROOF_HEX_CHARS = 128  # an Ed25519 signature: 64 bytes
# Signed before the claim itself, so the signature can never stand for any other message.
# v2: the claim covers the session's channel binding (v1 did not, and could be replayed).
_CLAIM_LABEL = b"lynx-sglang prefill rank claim v2\0"


def _claim_message(rank: tuple[str, int], decode_address: str, binding: bytes) -> bytes:
    return _CLAIM_LABEL + json.dumps([rank[0], rank[1], decode_address, binding.hex()]).encode()


class RankKey:
    """This process's rank key pair (the private half stays in memory, in this object)."""

    def __init__(self) -> None:
        self._private = Ed25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw,
                                                              PublicFormat.Raw).hex()

    def sign(self, rank: tuple[str, int], decode_address: str, binding: bytes) -> str:
        return self.sign_bytes(_claim_message(rank, decode_address, binding))

    def sign_bytes(self, message: bytes) -> str:
        """The signature of `message` (hex); callers put a label of their own first
        (`backend.registration`), so that no signature stands for two kinds of message."""
        return self._private.sign(message).hex()


@dataclass(frozen=True)
class Claimant:
    """The prefill's side of a rank claim: its identity and the key that proves it."""

    identity: Identity
    key: RankKey

    def claim(self, decode_address: str, binding: bytes) -> Identity:
        """The identity to announce on the session with channel binding `binding` to the decode
        at `decode_address`."""
        return replace(self.identity, key=self.key.public,
                       proof=self.key.sign(self.identity.rank, decode_address, binding))


def proven(who: Identity, decode_address: str, binding: bytes) -> bool:
    """Whether `who.proof` is its `who.key`'s signature of its claim to the decode at
    `decode_address` on the session with channel binding `binding` (untrusted peer input:
    anything malformed is False; the key must be as the prefill registers it, since the decode
    compares it with the registered one as a string)."""
    return signed_by(who.key, _claim_message(who.rank, decode_address, binding), who.proof)


def signed_by(key: object, message: bytes, proof: object) -> bool:
    """Whether `proof` (hex) is rank key `key`'s signature of `message` (untrusted input:
    anything malformed is False)."""
    if valid_key(key) is None or not isinstance(proof, str) or len(proof) != PROOF_HEX_CHARS:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(key)).verify(bytes.fromhex(proof),
                                                                      message)
    except (ValueError, InvalidSignature):
        return False
    return True


def valid_key(key: object) -> str | None:
    """`key` if it is a rank key's public half as the prefill registers it (lowercase hex), else
    None: the decode compares keys as strings."""
    if not isinstance(key, str) or len(key) != KEY_HEX_CHARS:
        return None
    try:
        canonical = bytes.fromhex(key).hex()  # fromhex skips spaces: compare the round trip
    except ValueError:
        return None
    return key if canonical == key else None
