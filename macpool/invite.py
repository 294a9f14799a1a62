"""A join line: what a new Mac needs to join the pool, as one string to paste.

``macpool pool invite --node-id ID`` makes one on the operator's side; ``macpool agent join LINE`` reads it on
the Mac. The line holds secrets (the Redis password, the node's token): send it to that Mac only, as a
password. It is base64 of a JSON document, so nothing in it is hidden from whoever holds it.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import SettingsConfigDict

from macpool.contract import now_ms
from macpool.identity import IdentityError, check_node_id, issue, load_secret
from macpool.settings import CommandSettings, ConfigError, RedisUrl, UserPath
from macpool.store import DEFAULT_PREFIX
from macpool.store.connect import parse

SCHEME = "macpool-join-1."  # the format's version: a later format gets a new one


class InvitationError(ValueError):
    """A line that is no join line; the message says what is wrong with it, never its secrets."""


class Invitation(BaseModel):
    """What a Mac needs to join: where the pool is, who this Mac is in it, and what proves it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: RedisUrl
    key_prefix: str = DEFAULT_PREFIX
    node_id: str = Field(pattern=r"^\S+$")
    token: str | None = None  # the agent token the routers send; None on a pool without one
    # this node's credential (`macpool node add`'s line) when the pool has node identity: instead of a token
    credential: str | None = None

    def encode(self) -> str:
        raw = json.dumps(self.model_dump(exclude_none=True), separators=(",", ":")).encode()
        return SCHEME + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, line: str) -> Invitation:
        line = line.strip()
        if not line.startswith(SCHEME):
            raise InvitationError(f"not a join line: one starts with {SCHEME!r} (`macpool pool invite`)")
        body = line[len(SCHEME):]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            return cls.model_validate(json.loads(raw))
        except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
            raise InvitationError("the join line is cut or mistyped: copy it again, whole") from None
        except ValidationError as exc:
            fields = ", ".join(".".join(str(p) for p in e["loc"]) or "line" for e in exc.errors())
            raise InvitationError(f"the join line does not hold a valid {fields}") from None


class InviteSettings(CommandSettings):
    """
    Print the line a new Mac joins the pool with: `macpool agent join LINE` on that Mac. The line holds the
    pool's Redis URL (with its password) and the agent token: send it to that Mac only.
    """

    model_config = SettingsConfigDict(cli_prog_name="macpool pool invite")
    config_table = "invite"

    node_id: str = Field(pattern=r"^\S+$", description="the new Mac's id in the pool, different on every Mac")
    redis_url: RedisUrl = Field(
        default="redis://127.0.0.1:6379/0",
        description="the pool's Redis as the new Mac reaches it (a LAN address, not 127.0.0.1)",
    )
    key_prefix: str = Field(default=DEFAULT_PREFIX, description="Redis key prefix (as the routers')")
    agent_token: str | None = Field(
        default=None, description="the token the routers send to agents (as the routers' --agent-token)"
    )
    pool_secret_file: UserPath | None = Field(
        default=None,
        description="the pool secret (`macpool node init`): the line then carries a credential issued for "
        "this node, and no shared token (docs/security.md, Node identity)",
    )


def main(argv: list[str]) -> int:
    """``macpool pool invite``."""
    try:
        settings = InviteSettings.from_argv(argv)
    except ConfigError as exc:
        print(f"macpool pool invite: error: {exc}", file=sys.stderr)
        return 2
    target = parse(settings.redis_url)
    host = target.hosts[0][0] if target.hosts else urlsplit(settings.redis_url).hostname or "a local socket"
    if host in ("127.0.0.1", "localhost", "::1", "a local socket"):
        print(f"macpool pool invite: warning: the Redis URL names {host}: another Mac reaches this host by "
              "its LAN address (--redis-url)", file=sys.stderr)
    credential, token = None, settings.agent_token
    if settings.pool_secret_file is not None:
        try:
            issued = issue(load_secret(settings.pool_secret_file), check_node_id(settings.node_id), now_ms())
        except IdentityError as exc:
            print(f"macpool pool invite: error: {exc}", file=sys.stderr)
            return 2
        credential, token = issued.encode(), None
    line = Invitation(redis_url=settings.redis_url, key_prefix=settings.key_prefix, node_id=settings.node_id,
                      token=token, credential=credential).encode()
    print(f"macpool agent join {line}")
    return 0
