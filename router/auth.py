"""Client API keys and the admin key: stored as SHA-256 digests, compared in constant time.

The keys file has one key per line - a plaintext key or its 64-hex-digit SHA-256 digest - optionally
followed by attributes of that key's tenant::

    sk-team-a-key                 name=team-a  max_concurrency=8
    3f1c...e9 (a digest)          name=nightly priority=batch

``name`` identifies the tenant in fair queueing, metrics and the dashboard (default: ``key-`` and the
first 8 hex digits of the digest); ``priority`` is the default class of its requests (``interactive`` or
``batch``; the ``X-Macpool-Priority`` header overrides it); ``max_concurrency`` bounds its requests in
flight plus queued (429 above; default: the router's ``key_max_concurrency``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from macpool.contract import Priority
from router.settings import ConfigError

_HEX_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
PRIORITIES = ("interactive", "batch")


@dataclass(frozen=True)
class ApiKey:
    digest: bytes
    tenant: str
    priority: Priority | None = None
    max_concurrency: int | None = None


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def load_api_keys(path: Path) -> list[ApiKey]:
    """Read the keys file (format in the module docstring). Blank lines and ``#`` lines are ignored."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"api_keys_file={str(path)!r}: {exc.strerror}") from None
    keys = []
    for number, line in enumerate(lines, 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        key, *attributes = entry.split()
        keys.append(_parse_key(key, attributes, f"api_keys_file={str(path)!r} line {number}"))
    if not keys:
        raise ConfigError(f"api_keys_file={str(path)!r}: no keys in the file")
    names = [k.tenant for k in keys]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ConfigError(f"api_keys_file={str(path)!r}: tenant name used twice: {', '.join(duplicated)}")
    return keys


def _parse_key(key: str, attributes: list[str], where: str) -> ApiKey:
    raw = bytes.fromhex(key) if _HEX_DIGEST.match(key) else digest(key)
    fields: dict[str, str] = {}
    for attribute in attributes:
        name, sep, value = attribute.partition("=")
        if not sep or name not in ("name", "priority", "max_concurrency"):
            known = "name=, priority=, max_concurrency="
            raise ConfigError(f"{where}: unknown attribute {attribute!r} ({known})")
        fields[name] = value
    tenant = fields.get("name", f"key-{raw.hex()[:8]}")
    if not _TENANT_NAME.match(tenant):
        raise ConfigError(f"{where}: name={tenant!r} must be 1-64 of A-Z a-z 0-9 _ . -")
    priority = fields.get("priority")
    if priority is not None and priority not in PRIORITIES:
        raise ConfigError(f"{where}: priority={priority!r} must be interactive or batch")
    limit = fields.get("max_concurrency")
    if limit is not None and not (limit.isdigit() and int(limit) > 0):
        raise ConfigError(f"{where}: max_concurrency={limit!r} must be a whole number above 0")
    return ApiKey(raw, tenant, cast(Priority | None, priority), int(limit) if limit else None)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client presents: ``Authorization: Bearer`` (OpenAI clients), else ``x-api-key``
    (Anthropic clients)."""
    return bearer_token(headers.get("authorization")) or headers.get("x-api-key") or None


class KeyRing:
    """A set of accepted keys; an empty ring accepts every request (as the anonymous tenant)."""

    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def match(self, presented: str | None) -> ApiKey | None:
        """The key presented, or None (also None for an empty ring: check ``enabled``)."""
        if not self.keys or presented is None:
            return None
        candidate = digest(presented)
        # compare against every digest so the time taken does not depend on which key matched
        found = None
        for key in self.keys:
            if hmac.compare_digest(candidate, key.digest):
                found = key
        return found

    def accepts(self, presented: str | None) -> bool:
        return not self.keys or self.match(presented) is not None
