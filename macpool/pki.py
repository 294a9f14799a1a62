"""A small pool's PKI (``macpool pool certs``): one CA, and a certificate for each router, node and Redis.

Every certificate is for TLS servers and clients alike: a router serves its clients and shows the same
certificate to the agents (mutual TLS), an agent serves the routers, and any of them may show theirs to a
Redis that asks its clients for one. Files in the output folder:

- ``ca.pem`` (give it to every process: the trust root) and ``ca-key.pem`` (keep it off the Macs);
- ``router.pem``/``router-key.pem``, ``redis.pem``/``redis-key.pem``, ``node-<ID>.pem``/``node-<ID>-key.pem``.

Keys are ECDSA P-256, written 0600. A folder that has a CA already keeps it, so a Mac joining later gets a
certificate of the same CA. Leaf certificates last 825 days: the longest that macOS accepts for a TLS
server certificate.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
LEAF_DAYS = 825
SKEW = datetime.timedelta(hours=1)  # valid from a little before now: the Macs' clocks differ
NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a node id that is also a file name
HOST_NAME = re.compile(r"^(?=.{1,253}$)(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


class PkiError(ValueError):
    """A host, a node id or a file that cannot make a certificate; the message names it."""


@dataclass(frozen=True)
class Issued:
    """A key and its certificate."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def write(self, cert_path: Path, key_path: Path) -> None:
        """The certificate (0644) and the key (0600, never readable by others, not even for a moment)."""
        cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        key_pem = self.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o600)  # a key file that was there keeps its mode otherwise
            out.write(key_pem)


@dataclass(frozen=True)
class Authority(Issued):
    """A CA: its certificate signs those of :meth:`issue`."""

    @classmethod
    def create(cls, name: str = "macpool pool CA", days: int = CA_DAYS) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                              content_commitment=False, key_encipherment=False, data_encipherment=False,
                              key_agreement=False, encipher_only=False, decipher_only=False)
        cert = (
            _builder(subject, subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(usage, critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, cert_path: Path, key_path: Path) -> Authority:
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise PkiError(f"the CA in {cert_path.parent}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise PkiError(f"{key_path} is not the key of {cert_path}")
        return cls(key, cert)

    def issue(self, name: str, hosts: Iterable[str], days: int = LEAF_DAYS) -> Issued:
        """A certificate for ``hosts`` (names and IP addresses), for a TLS server and client alike."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        usage = x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                              content_commitment=False, key_encipherment=False, data_encipherment=False,
                              key_agreement=False, encipher_only=False, decipher_only=False)
        cert = (
            _builder(subject, self.cert.subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([subject_name(h) for h in hosts]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return Issued(key, cert)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def subject_name(host: str) -> x509.GeneralName:
    """``host`` as a certificate names it: an IP address, else a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not HOST_NAME.match(host):
        raise PkiError(f"{host!r} is neither an IP address nor a host name")
    return x509.DNSName(host.rstrip(".").lower())


def node_spec(text: str) -> tuple[str, list[str]]:
    """``ID=HOST[,HOST...]`` -> (id, hosts)."""
    node_id, sep, hosts = text.partition("=")
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if not sep or not names:
        raise PkiError(f"--node {text!r}: expected ID=HOST[,HOST...] (mac-1=mac-1.local,192.168.1.21)")
    if not NODE_ID.match(node_id):
        raise PkiError(f"--node {text!r}: the node id {node_id!r} takes letters, digits, '.', '_' and '-'")
    return node_id, names


@dataclass(frozen=True)
class PoolCerts:
    """What ``macpool pool certs`` makes in ``out``: for the routers, each node and Redis."""

    out: Path
    routers: Sequence[str] = ()
    nodes: dict[str, list[str]] | None = None
    redis: Sequence[str] = ()

    def plan(self) -> list[tuple[str, list[str], Path, Path]]:
        """(name, hosts, certificate file, key file) of each certificate to make, the hosts checked."""
        leaves = [("router", list(self.routers))] if self.routers else []
        leaves += [(f"node-{node_id}", hosts) for node_id, hosts in (self.nodes or {}).items()]
        leaves += [("redis", list(self.redis))] if self.redis else []
        for _, hosts in leaves:
            for host in hosts:
                subject_name(host)
        return [(name, hosts, self.out / f"{name}.pem", self.out / f"{name}-key.pem")
                for name, hosts in leaves]

    def make(self, force: bool = False) -> tuple[bool, list[Path]]:
        """Make the certificates (and the CA when ``out`` has none); (whether the CA is new, the files
        written). An existing certificate is kept unless ``force``: a PkiError names it."""
        plan = self.plan()
        if not plan:
            raise PkiError("nothing to make: give --router HOST..., --node ID=HOST... or --redis HOST...")
        existing = [path for *_, cert, key in plan for path in (cert, key) if path.exists()]
        if existing and not force:
            raise PkiError(f"{existing[0]} exists: --force to replace it (its key and certificate)")
        self.out.mkdir(mode=0o700, parents=True, exist_ok=True)
        ca_cert, ca_key = self.out / "ca.pem", self.out / "ca-key.pem"
        written: list[Path] = []
        new_ca = not ca_cert.exists()
        if new_ca:
            if ca_key.exists():
                raise PkiError(f"{ca_key} exists without ca.pem: move it away or put its certificate back")
            ca = Authority.create()
            ca.write(ca_cert, ca_key)
            written += [ca_cert, ca_key]
        else:
            ca = Authority.load(ca_cert, ca_key)
        for name, hosts, cert, key in plan:
            ca.issue(name, hosts).write(cert, key)
            written += [cert, key]
        return new_ca, written


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="macpool pool certs",
        description="Make a pool CA (or use the one in --out) and certificates for the routers, the nodes "
        "and Redis, each naming the hosts and IP addresses it is reached at (docs/security.md, TLS).",
    )
    p.add_argument("--out", type=Path, required=True, help="folder of the files (made 0700 if missing)")
    p.add_argument("--router", nargs="+", default=[], metavar="HOST",
                   help="the routers' host names and IP addresses: one certificate, router.pem")
    p.add_argument("--node", action="append", default=[], metavar="ID=HOST[,HOST...]",
                   help="a node (agent) id and its host names and IP addresses: node-ID.pem (repeat per Mac)")
    p.add_argument("--redis", nargs="+", default=[], metavar="HOST",
                   help="Redis's host names and IP addresses (its servers and sentinels): redis.pem")
    p.add_argument("--force", action="store_true", help="replace certificates and keys that exist")
    return p


def main(argv: list[str]) -> int:
    """``macpool pool certs``."""
    args = _parser().parse_args(argv)
    try:
        nodes = dict(node_spec(text) for text in args.node)
        if len(nodes) != len(args.node):
            raise PkiError("--node: a node id given twice")
        new_ca, written = PoolCerts(args.out, args.router, nodes, args.redis).make(args.force)
    except PkiError as exc:
        print(f"macpool pool certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"macpool pool certs: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(("a new CA" if new_ca else "the CA") + f" in {args.out}: ca.pem (give it to every router, agent "
          "and Redis), ca-key.pem (keep it off the Macs)")
    for path in written:
        if path.name not in ("ca.pem", "ca-key.pem"):
            print(f"  {path}")
    return 0
