"""Client API keys and the admin key: stored as SHA-256 digests, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from router.settings import ConfigError

_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_key_digests(path: Path) -> list[bytes]:
    """One key per line: a 64-hex-digit SHA-256 digest, or a plaintext key (hashed here).

    Blank lines and lines starting with ``#`` are ignored.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"api_keys_file={str(path)!r}: {exc.strerror}") from None
    digests = []
    for line in lines:
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        digests.append(bytes.fromhex(entry) if _HEX_DIGEST.match(entry) else digest(entry))
    if not digests:
        raise ConfigError(f"api_keys_file={str(path)!r}: no keys in the file")
    return digests


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


class KeyRing:
    """A set of accepted key digests; an empty ring accepts every request."""

    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def accepts(self, presented: str | None) -> bool:
        if not self.digests:
            return True
        if presented is None:
            return False
        candidate = digest(presented)
        # compare against every digest so the time taken does not depend on which key matched
        found = False
        for stored in self.digests:
            found |= hmac.compare_digest(candidate, stored)
        return found
