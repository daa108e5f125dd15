"""TLS for the tcp backend's data connections: `TlsConfig` (certificate, key, CA) and the SSL
contexts built from it.

Who uses it: `lynx_transport.tcp` (``backend_options={"tls": TlsConfig(...)}``) wraps every data
connection of a session in TLS 1.3 with certificates checked both ways against the operator's CA.
The control plane (zmq) is not wrapped: its messages are authenticated per message (HMAC, see the
package docstring) and carry no KV bytes and no tokens (the tcp FIN frames that carry a stream's
aux travel on the data connections).

Why one direction per connection: an SSL object must not be read and written by two threads at
once, and the tcp backend reads with one thread per socket while another sends. So with TLS a
session opens four connections, one per stream and direction, each written by one end only and
read by the other; TLS 1.3 session tickets are off (`num_tickets = 0`) so that no TLS record ever
travels against a connection's direction after the handshake.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path


class TlsConfigError(ValueError):
    """A TLS setting that cannot be used: the file and the reason are named."""


@dataclass(frozen=True)
class TlsConfig:
    """PEM files of this endpoint's certificate chain and key, and of the CA that signed its
    peers' certificates. `check_hostname`: the dialing end also checks that the peer's certificate
    names the host it dialed (an IP address SAN for an IP); certificates are required and checked
    against `ca_file` both ways in every case."""

    cert_file: str
    key_file: str
    ca_file: str
    check_hostname: bool = True

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TlsConfigError(f"TLS {name} must be a path, got {value!r}")
            if not Path(value).is_file():
                raise TlsConfigError(f"TLS {name} {value}: no such file")

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH
                             else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"TLS certificate {self.cert_file} with key {self.key_file}: "
                                 f"{exc}") from None
        try:
            ctx.load_verify_locations(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsConfigError(f"TLS CA file {self.ca_file}: {exc}") from None
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """The accepting end's context: asks for and checks the dialer's certificate."""
        ctx = self._context(ssl.Purpose.CLIENT_AUTH)
        ctx.num_tickets = 0
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The dialing end's context (host name checked when `check_hostname`)."""
        ctx = self._context(ssl.Purpose.SERVER_AUTH)
        ctx.check_hostname = self.check_hostname
        return ctx

    @cached_property
    def _contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        return self.server_context(), self.client_context()

    def contexts(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        """(server, client) contexts; TlsConfigError names a file that does not load. Built once
        per config (the launch's check and the tcp backend share them: loading the key and CA
        twice costs a few ms each and could read a file replaced in between); a failed load is
        not kept, so a fixed file is read on the next call."""
        return self._contexts
