"""``macpool pool certs`` (macpool/pki.py): a CA and certificates that verify for their hosts, and for no
others, keys that only their owner reads, a CA kept across runs."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from macpool.cli import main


def _verify(folder: Path, name: str, host: str) -> None:
    """Verify ``name``.pem as a TLS server at ``host`` against the CA in ``folder``."""
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    leaf = x509.load_pem_x509_certificate((folder / f"{name}.pem").read_bytes())
    subject = x509.IPAddress(ipaddress.ip_address(host)) if host[0].isdigit() else x509.DNSName(host)
    PolicyBuilder().store(Store([ca])).build_server_verifier(subject).verify(leaf, [])


def test_a_pool_pki_in_one_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pki"
    assert main(["pool", "certs", "--out", str(out), "--router", "router.lan", "10.0.0.5",
                 "--node", "mac-1=mac-1.local,192.168.1.21", "--node", "mac-2=mac-2.local",
                 "--redis", "redis.lan"]) == 0
    said = capsys.readouterr().out
    assert "a new CA" in said and "node-mac-1.pem" in said
    for name, host in (("router", "router.lan"), ("router", "10.0.0.5"), ("node-mac-1", "mac-1.local"),
                       ("node-mac-1", "192.168.1.21"), ("node-mac-2", "mac-2.local"), ("redis", "redis.lan")):
        _verify(out, name, host)
    # a certificate names its own hosts only: one Mac's cannot serve as another's
    for name, host in (("node-mac-1", "mac-2.local"), ("node-mac-2", "192.168.1.21"),
                       ("router", "mac-1.local")):
        with pytest.raises(VerificationError):
            _verify(out, name, host)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    keys = sorted(p.name for p in out.iterdir() if p.name.endswith("-key.pem"))
    assert keys == ["ca-key.pem", "node-mac-1-key.pem", "node-mac-2-key.pem", "redis-key.pem",
                    "router-key.pem"]
    for key in keys:
        assert stat.S_IMODE((out / key).stat().st_mode) == 0o600


def test_a_mac_joining_later_gets_a_certificate_of_the_same_ca(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pki"
    assert main(["pool", "certs", "--out", str(out), "--node", "mac-1=mac-1.local"]) == 0
    ca = (out / "ca.pem").read_bytes()
    assert main(["pool", "certs", "--out", str(out), "--node", "mac-2=mac-2.local"]) == 0
    assert (out / "ca.pem").read_bytes() == ca
    assert "the CA in" in capsys.readouterr().out
    _verify(out, "node-mac-2", "mac-2.local")
    # an existing certificate is replaced only when asked
    first = (out / "node-mac-1.pem").read_bytes()
    assert main(["pool", "certs", "--out", str(out), "--node", "mac-1=mac-1.local"]) == 2
    assert "node-mac-1.pem exists: --force" in capsys.readouterr().err
    assert (out / "node-mac-1.pem").read_bytes() == first
    (out / "node-mac-1-key.pem").chmod(0o644)
    assert main(["pool", "certs", "--out", str(out), "--node", "mac-1=mac-1.local", "--force"]) == 0
    assert (out / "node-mac-1.pem").read_bytes() != first
    assert stat.S_IMODE((out / "node-mac-1-key.pem").stat().st_mode) == 0o600


@pytest.mark.parametrize(("args", "said"), [
    (["--node", "mac-1"], "expected ID=HOST"),
    (["--node", "mac/1=mac.local"], "the node id 'mac/1'"),
    (["--node", "mac-1=bad_host!"], "'bad_host!' is neither an IP address nor a host name"),
    (["--node", "a=a.local", "--node", "a=b.local"], "a node id given twice"),
    ([], "nothing to make"),
])
def test_bad_input_gets_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                 said: str) -> None:
    assert main(["pool", "certs", "--out", str(tmp_path / "pki"), *args]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "pki").exists()
