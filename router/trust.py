"""Which heartbeats a router believes: signed by the node's own credential, fresh, not revoked, and pointing
into the networks the operator allows (docs/security.md, "Node identity").

A node this refuses gets no traffic: the pool view keeps it out of the candidates (router/pool.py) and shows
it as untrusted, with the reason, on ``/api/pool``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit

from macpool.contract import NodeDoc, now_ms
from macpool.identity import (
    IdentityError,
    PoolSecret,
    Revocation,
    covers,
    credential_of,
    load_secret,
    verify_signature,
)
from macpool.settings import ConfigError, network_list
from router.settings import Settings

log = logging.getLogger("macpool.router")

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
RESOLVE_TIMEOUT_S = 2.0
RESOLVED_FOR_S = 30.0  # a host name is resolved again this often (its addresses may move)
PENDING = "its URL's host is being resolved"  # not a refusal: the node waits for the next pool read
# the records ``macpool autoscale`` keeps of a Mac asleep (autoscaler/controller.py): unsigned and without
# a URL, they only tell routers which models a woken Mac would serve
PLACEHOLDER_STATES = ("asleep", "waking")


@dataclass(frozen=True)
class Host:
    """What a node URL's host name resolved to, checked against the allowed networks."""

    refusal: str | None  # why its addresses are not allowed, or None
    at: float  # when (monotonic)


class NodeTrust:
    """The router's judgement of each heartbeat, and the revocations it has seen (never forgotten)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.secret: PoolSecret | None = None
        if settings.pool_secret_file is not None:
            try:
                self.secret = load_secret(settings.pool_secret_file)
            except IdentityError as exc:
                raise ConfigError(f"--pool-secret-file: {exc}") from None
        self.required = self.secret is not None and settings.node_identity == "required"
        self.networks: list[IPNetwork] = network_list(settings.node_networks)
        self.hosts: dict[str, Host] = {}
        # node id -> the newest valid revocation record seen: deleting it from Redis changes nothing here
        self.revocations: dict[str, Revocation] = {}
        self._bad_records: set[tuple[str, str]] = set()  # (node id, record) refused already, logged once
        self.signed: set[str] = set()  # node ids seen signed: an unsigned heartbeat for one is refused
        self._tokens: dict[tuple[str, int], str] = {}  # signer (id, issued) -> its agent token

    # --- judging a heartbeat -----------------------------------------------------------------------

    def refusal(self, doc: NodeDoc, now: int | None = None) -> str | None:
        """Why ``doc`` gets no traffic, or None when it may. ``PENDING`` while its host is resolved."""
        if not doc.url and doc.state in PLACEHOLDER_STATES:
            return self._revoked(doc)  # the autoscaler's record of a sleeping Mac: no traffic can go to it
        now = now_ms() if now is None else now
        return self._identity(doc, now) or self._revoked(doc) or self._network(doc)

    def _identity(self, doc: NodeDoc, now: int) -> str | None:
        if self.secret is None:
            return None
        if not doc.signature and not self.required:
            mac = doc.node_id.split("/", 1)[0]
            return "unsigned heartbeat for a node id that signed before" if mac in self.signed else None
        refusal = verify_signature(self.secret, doc)
        if refusal is not None:
            return refusal
        window = self.settings.stale_after + self.settings.node_clock_skew
        if now - doc.updated_at_ms > window * 1000:
            return f"stale or replayed heartbeat: signed more than {window:g} s ago"
        if doc.updated_at_ms - now > self.settings.node_clock_skew * 1000:
            skew = self.settings.node_clock_skew
            return f"heartbeat signed more than {skew:g} s in the future (clock skew)"
        self.signed.add(doc.signer)
        return None

    def _revoked(self, doc: NodeDoc) -> str | None:
        if doc.signature:  # (verified by then): its own credential, if issued before the revocation
            record = self.revocations.get(doc.signer)
            if record is not None and doc.signer_issued_ms < record.before_ms:
                return f"credential of {doc.signer!r} revoked by the operator"
            return None
        for node_id in {doc.node_id, doc.node_id.split("/", 1)[0]}:  # unsigned: any revocation of the id
            if node_id in self.revocations:
                return f"node {node_id!r} revoked by the operator"
        return None

    def _network(self, doc: NodeDoc) -> str | None:
        host = urlsplit(doc.url).hostname
        if not host:
            return f"URL {doc.url!r} names no host"
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            resolved = self.hosts.get(host)
            return PENDING if resolved is None else resolved.refusal
        return self._outside([address], host)

    def _outside(self, addresses: list[IPAddress], host: str) -> str | None:
        for address in addresses:
            mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:10.0.0.1 is 10.0.0.1
            checked = mapped or address
            if not any(checked in network for network in self.networks):
                shown = host if str(address) == host else f"{host} ({address})"
                return f"URL host {shown} is outside --node-networks"
        return None

    # --- what the pool read brings -----------------------------------------------------------------

    def note_revocations(self, records: dict[str, str]) -> None:
        """Learn the operator's signed revocations; a later one replaces an earlier one, and one that
        disappears from Redis is remembered all the same."""
        if self.secret is None:
            return
        for node_id, raw in records.items():
            try:
                record = Revocation.decode(node_id, raw)
                valid = record.valid(self.secret)
            except IdentityError:
                valid = False
            if not valid:
                if (node_id, raw) not in self._bad_records:
                    self._bad_records.add((node_id, raw))
                    log.warning("revocation record of node %s is not signed with the pool secret; ignored "
                                "(someone with write access to Redis wrote it)", node_id,
                                extra={"node": node_id})
                continue
            known = self.revocations.get(node_id)
            if known is None or record.before_ms > known.before_ms:
                self.revocations[node_id] = record
                log.warning("node %s: the credentials issued for it before %s are revoked", node_id,
                            _iso(record.before_ms), extra={"node": node_id})

    async def resolve(self, docs: list[NodeDoc]) -> None:
        """Resolve the host names of ``docs``' URLs not resolved lately, at once, each bounded in time."""
        now = time.monotonic()
        names = set()
        for doc in docs:
            host = urlsplit(doc.url).hostname
            if not host or _is_address(host):
                continue
            known = self.hosts.get(host)
            if known is None or now - known.at > RESOLVED_FOR_S:
                names.add(host)
        if names:
            results = await asyncio.gather(*(self._resolve(name) for name in names))
            self.hosts.update(zip(names, results, strict=True))

    async def _resolve(self, host: str) -> Host:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError) as exc:
            return Host(f"URL host {host} does not resolve ({type(exc).__name__})", time.monotonic())
        addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
        return Host(self._outside(addresses, host), time.monotonic())

    # --- talking to a node -------------------------------------------------------------------------

    def agent_token(self, doc: NodeDoc) -> str | None:
        """The X-Macpool-Token for ``doc``'s agent: its own when it signs, else the shared one."""
        if self.secret is None or not doc.signer or not covers(doc.signer, doc.node_id):
            return self.settings.agent_token
        signer = (doc.signer, doc.signer_issued_ms)
        token = self._tokens.get(signer)
        if token is None:
            token = self._tokens[signer] = credential_of(self.secret, doc).agent_token
        return token


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
