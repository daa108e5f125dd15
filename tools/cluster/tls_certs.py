"""`lynx-sglang tls-certs`: a private CA and node certificates for the tcp transport's TLS.

Who calls it: the CLI (`lynx-sglang tls-certs`), `lynx-sglang up --tls` (one CA and one node
certificate for the local cluster) and the tests. The runtime only reads the files
(`--lynx-tls-cert/--lynx-tls-key/--lynx-tls-ca`, `lynx_transport.tls.TlsConfig`).

A cluster that has a PKI should use it instead: any TLS 1.3-capable certificate chain works, with
an IP address or DNS name SAN for every host the prefills dial (the decode's `--host`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"


@dataclass(frozen=True)
class CertFiles:
    """The three files a server's `--lynx-tls-*` flags name."""

    cert_file: Path
    key_file: Path
    ca_file: Path

    def flags(self) -> list[str]:
        return ["--lynx-tls-cert", str(self.cert_file), "--lynx-tls-key", str(self.key_file),
                "--lynx-tls-ca", str(self.ca_file)]


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "lynx-sglang"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _load_or_make_ca(out: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = out / CA_CERT, out / CA_KEY
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an EC key (made by another tool?)")
        return cert, key
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    name = _name("lynx-sglang cluster CA")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def make_certs(out_dir: str | Path, hosts: list[str], name: str = "node",
               days: int = 365) -> CertFiles:
    """A node certificate `<name>.pem` + `<name>-key.pem` for `hosts` (IP addresses or DNS
    names; it serves as both TLS server and client), signed by the CA in `out_dir` (made there
    first if absent: `ca.pem`, `ca-key.pem`, the key readable by its owner only)."""
    if not hosts:
        raise ValueError("a node certificate needs at least one host (IP address or DNS name)")
    if not name or "/" in name or name.startswith("ca"):
        raise ValueError(f"bad certificate name {name!r} (a file name, not starting with 'ca')")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = _load_or_make_ca(out, days)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(f"lynx-sglang {name}"))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = CertFiles(out / f"{name}.pem", out / f"{name}-key.pem", out / CA_CERT)
    _write_key(files.key_file, key)
    files.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return files


def add_arguments(parser) -> None:
    parser.add_argument("--out", required=True, type=Path,
                        help="folder of the CA (ca.pem, ca-key.pem: made there if absent, reused "
                             "otherwise) and of the node certificate")
    parser.add_argument("--host", action="append", required=True, metavar="ADDR",
                        help="an IP address or DNS name the node is dialed at (its --host); "
                             "repeat for several")
    parser.add_argument("--name", default="node",
                        help="file stem of the node certificate: NAME.pem and NAME-key.pem")
    parser.add_argument("--days", type=int, default=365, help="validity of new certificates")


def run(args) -> int:
    files = make_certs(args.out, args.host, name=args.name, days=args.days)
    print(f"CA {files.ca_file} (its key {args.out / CA_KEY} signs more nodes: keep it off the "
          f"servers); node certificate for {', '.join(args.host)}:")
    print(" ".join(files.flags()))
    return 0
