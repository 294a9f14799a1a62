"""The router's one settings object, and its command line (``macpool router``): flags > ``MACPOOL_*``
environment > ``--config`` TOML file (top-level keys or a ``[router]`` table) > defaults."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Literal, Self

from pydantic import AliasGenerator, Field, model_validator
from pydantic_settings import SettingsConfigDict

from macpool.credentials import check_secret, exposed_without_auth, is_loopback, read_secret
from macpool.scaling import MinNodes, ScalePolicy
from macpool.serving import check_tls_files
from macpool.settings import CommandSettings, ConfigError, Hosts, Networks, Origins, RedisUrl, UserPath
from macpool.store import DEFAULT_PREFIX
from router.aliases import AliasTable

__all__ = ["ConfigError", "Settings"]

# loopback, the private ranges (RFC 1918, IPv6 ULA) and link-local (a Thunderbolt bridge between Macs)
LAN_NETWORKS = ("127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,169.254.0.0/16,fc00::/7,"
                "fe80::/10")


def _scale_prefixed(name: str) -> str:
    """The router's name of a setting: ``scale_`` and the knob for the scale policy's, the name itself for
    the others."""
    return f"scale_{name}" if name in ScalePolicy.model_fields else name


def host_pid_random() -> str:
    """A router replica's default id: its host, its process and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class _Serving(CommandSettings):
    """The router's settings but for its scale hint's and its process's, which :class:`Settings` adds after
    these (``--help`` lists the settings in the order their classes declare them)."""

    config_table = "router"

    redis_url: RedisUrl = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL shared with the agents and the other router replicas: redis://, rediss://, "
        "unix://, redis+sentinel:// or redis+cluster://",
    )
    host: str = Field(default="127.0.0.1", description="address to listen on (0.0.0.0 to serve the LAN)")
    port: int = Field(default=8080, ge=0, le=65535, description="port to listen on")
    key_prefix: str = Field(default=DEFAULT_PREFIX, description="prefix of every Redis key (as the agents')")
    router_id: str = Field(default_factory=host_pid_random, description="this replica's id")

    # admission
    queue_size: int = Field(
        default=64, ge=0,
        description="global bound of the wait queue, across all replicas (0: no queue)",
    )
    queue_timeout: float = Field(
        default=2.0, ge=0,
        description="seconds a request may wait in the queue before 503 queue_timeout",
    )
    # scale to zero (router/cold_start.py)
    cold_start_timeout: float = Field(
        default=60.0, ge=0,
        description="seconds a request waits while a standby node loads its model, when no node of its "
        "model is ready (then 503 cold_start; 0: at once)",
    )
    load_on_demand: bool = Field(
        default=True,
        description="a request for a model no ready node serves asks a standby node of it to load it, once "
        "for every router (--no-load-on-demand: only the autoscaler loads)",
    )
    lease_seconds: float = Field(
        default=30.0, gt=0,
        description="reservation lease; live requests renew it, a crashed router's expire",
    )
    liveness_seconds: float = Field(
        default=4.0, gt=0,
        description="a router that has not beaten in Redis for this long counts as dead: the other routers "
        "give its reservations back",
    )
    default_model: str | None = Field(
        default=None,
        description="model used when a request names none (unset: any node)",
    )
    model_aliases: AliasTable = Field(
        default={},
        description="names clients send for a served model, NAME=MODEL or PATTERN=MODEL, comma-separated: "
        "exact names first, then patterns in order (claude-*=qwen3-coder)",
    )
    light_concurrency: int = Field(
        default=8, ge=1,
        description="light requests (token counts, templates) this router sends a node at once",
    )

    # prefix-cache affinity (router/affinity.py): prefer the node that served a request's prompt prefix,
    # unless it is busier than the node placement chose by both thresholds (SGLang's rule)
    affinity: bool = Field(
        default=True,
        description="prefer the node holding the prompt's prefix; --no-affinity routes by load only",
    )
    affinity_abs_threshold: int = Field(
        default=4, ge=0,
        description="affinity yields to the node placement chose when the preferred node has at least this "
        "many more requests in flight (and the relative threshold holds)",
    )
    affinity_rel_threshold: float = Field(
        default=1.5, ge=1.0,
        description="affinity yields when the preferred node's utilisation is over this multiple of "
        "placement's node's (and the absolute threshold holds)",
    )
    affinity_max_entries: int = Field(
        default=100_000, ge=1,
        description="prompt-prefix entries remembered in Redis (least recently used dropped)",
    )
    session_ttl: float = Field(
        default=300.0, ge=0,
        description="seconds a coding-agent session that sent no turn still counts as holding a slot's "
        "cache on its Mac, and as a turn to come there: a new session goes where it evicts none if it can, "
        "and weighs the turns each Mac's sessions will send (0: not counted)",
    )

    # placement (router/placement.py)
    placement: Literal["fastest", "least-utilised"] = Field(
        default="fastest",
        description="fastest: the node that would answer soonest, from each node's measured TTFT and "
        "per-slot decode speed; least-utilised: the node with the smallest share in use",
    )
    placement_tokens: int = Field(
        default=256, ge=1,
        description="answer length, in tokens, the fastest placement expects a request to ask for",
    )

    # priority classes and tenants (docs/router.md "Priorities, fairness and per-key limits")
    default_priority: Literal["interactive", "batch"] = Field(
        default="interactive",
        description="priority of requests without X-Macpool-Priority or a per-key default",
    )
    batch_queue_share: float = Field(
        default=0.25, ge=0.0, le=1.0,
        description="share of the queue batch requests may hold (0: batch never queues)",
    )
    key_max_concurrency: int = Field(
        default=0, ge=0,
        description="requests in flight (and queued) per API key, 429 above (0: no limit)",
    )

    # forwarding
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, gt=0,
        description="largest accepted request body (413 above)",
    )
    request_read_timeout: float = Field(
        default=30.0, gt=0,
        description="seconds a client may take to send a request's body, then 408",
    )
    connect_timeout: float = Field(default=2.0, gt=0, description="seconds to connect to an agent")
    first_byte_timeout: float = Field(
        default=120.0, gt=0,
        description="seconds from sending a streamed request to its first response byte",
    )
    response_timeout: float = Field(
        default=600.0, gt=0,
        description="seconds from sending a non-streamed request to its answer (it arrives whole, after the "
        "whole generation)",
    )
    idle_timeout: float = Field(
        default=60.0, gt=0,
        description="seconds allowed between two chunks of a response",
    )
    max_attempts: int = Field(
        default=3, ge=1,
        description="nodes tried per request before giving up (failover before the first byte)",
    )
    agent_token: str | None = Field(
        default=None,
        description="token sent to the agents in X-Macpool-Token (with --pool-secret-file: to unsigned nodes "
        "only; a signed node gets its own token). Prefer --agent-token-file or MACPOOL_AGENT_TOKEN: a flag "
        "shows in ps",
    )
    agent_token_file: UserPath | None = Field(
        default=None, description="file holding the agent token (its first line)",
    )

    # node identity (router/trust.py, docs/security.md "Node identity")
    pool_secret_file: UserPath | None = Field(
        default=None,
        description="file holding the pool secret (`macpool node init`; mode 600): heartbeats must be signed "
        "with a credential it issued (`macpool node add`), and each node gets its own agent token "
        "(unset: node identity off)",
    )
    node_identity: Literal["required", "optional"] = Field(
        default="required",
        description="with --pool-secret-file: required - an unsigned node gets no traffic; optional - while "
        "a pool moves to credentials, an unsigned node is trusted (and sent --agent-token) unless its id "
        "signed before",
    )
    node_clock_skew: float = Field(
        default=30.0, gt=0,
        description="seconds a signed heartbeat's time may differ from this router's clock beyond "
        "--stale-after: older ones are refused as replayed",
    )
    node_networks: Networks = Field(
        default=LAN_NETWORKS,
        description="networks node URLs may point into, comma-separated CIDRs; a node whose URL's host is "
        "(or resolves to) an address outside gets no traffic. Default: loopback, private and link-local",
    )

    # TLS (docs/security.md, "TLS"): HTTPS to clients, and to agents whose node URLs are https://
    tls_cert: UserPath | None = Field(
        default=None, description="serve HTTPS with this certificate chain (PEM; with --tls-key)",
    )
    tls_key: UserPath | None = Field(default=None, description="the private key of --tls-cert (PEM)")
    node_ca: UserPath | None = Field(
        default=None,
        description="an https:// node's certificate must chain to this CA (PEM: the pool CA of `macpool pool "
        "certs`) and name the node URL's host (unset: the system's CAs)",
    )
    node_cert: UserPath | None = Field(
        default=None,
        description="client certificate shown to agents that require one (--tls-client-ca; PEM; with "
        "--node-key)",
    )
    node_key: UserPath | None = Field(default=None, description="the private key of --node-cert (PEM)")

    # pool view and passive health
    refresh_interval: float = Field(default=1.0, gt=0, description="seconds between full reads of the pool")
    stale_after: float = Field(
        default=5.0, gt=0,
        description="a node whose heartbeat is older than this many seconds is not routed to",
    )
    circuit_failures: int = Field(
        default=3, ge=1,
        description="consecutive connect failures that open a node's circuit",
    )
    circuit_cooldown: float = Field(
        default=5.0, ge=0,
        description="seconds an open circuit waits before letting traffic probe the node",
    )

    # auth
    api_keys_file: UserPath | None = Field(
        default=None,
        description="client API keys, one per line: plaintext or SHA-256 hex digest, then optional "
        "name=TENANT priority=interactive|batch max_concurrency=N (unset: no client auth)",
    )
    admin_key: str | None = Field(
        default=None,
        description="bearer key for /admin/* and the observability endpoints (unset: admin API disabled; "
        "prefer --admin-key-file or MACPOOL_ADMIN_KEY: a flag shows in ps)",
    )
    admin_key_file: UserPath | None = Field(
        default=None, description="file holding the admin key (its first line)",
    )
    read_key: str | None = Field(
        default=None,
        description="bearer key for /metrics, /api/pool, its stream, /api/pool/scale and the dashboard's "
        "data, read-only (the admin key is accepted too); needed there once set, or once the router serves "
        "beyond loopback with keys (prefer --read-key-file or MACPOOL_READ_KEY)",
    )
    read_key_file: UserPath | None = Field(
        default=None, description="file holding the read key (its first line)",
    )
    trusted_network: bool = Field(
        default=False,
        description="serve beyond loopback with no client API keys: every host that reaches the port is "
        "trusted (without it such a router refuses to start)",
    )
    cors_origins: Origins | None = Field(
        default=None,
        description="browser origins allowed to call the API, comma-separated (https://chat.example.com), "
        "or * for any (unset: no CORS); a request from any other browser origin but the router's own is "
        "refused (403)",
    )
    allowed_hosts: Hosts | None = Field(
        default=None,
        description="host names the router answers to, comma-separated (macpool.lan, *.example.com: any "
        "name under it); a request whose Host is another name is refused (400), which stops a web page "
        "that rebinds its own name to the router's address (IP addresses, localhost and a request naming "
        "no host always pass; unset: any host)",
    )

    @model_validator(mode="after")
    def _tls_files(self) -> Self:
        if self.tls_cert is not None and self.tls_key is None:
            raise ValueError("--tls-cert needs --tls-key (the certificate's private key)")
        if self.node_cert is not None and self.node_key is None:
            raise ValueError("--node-cert needs --node-key (the certificate's private key)")
        check_tls_files(self.tls_cert, self.tls_key, None, ("--tls-cert", "--tls-key", ""))
        check_tls_files(self.node_cert, self.node_key, self.node_ca,
                        ("--node-cert", "--node-key", "--node-ca"))
        return self


class Settings(ScalePolicy, _Serving):
    """Run the pool's OpenAI-compatible router. docs/router.md, "Configuration", says more of each setting."""

    model_config = SettingsConfigDict(
        cli_prog_name="macpool router", alias_generator=AliasGenerator(validation_alias=_scale_prefixed)
    )

    # the scale hint (router/scale.py), how many Macs demand needs: ScalePolicy's knobs, each named
    # scale_<knob> here (--scale-target-utilisation, MACPOOL_SCALE_TARGET_UTILISATION), and where to POST it
    min_nodes: MinNodes = 1
    scale_webhook: str | None = Field(
        default=None, description="POST the scale hint (GET /api/pool/scale) here when desired_nodes changes"
    )

    # process
    shutdown_timeout: int = Field(
        default=15, ge=0,
        description="on SIGTERM, seconds in-flight requests may take to finish; streams still open then end "
        "with an SSE error event (router_shutdown)",
    )
    access_log: bool = Field(default=False, description="log every request")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="text, or json: one JSON object per line (uvicorn's lines too)",
    )

    @model_validator(mode="after")
    def _secrets(self) -> Settings:
        """The secrets from their files, each checked; and no open router beyond loopback unless trusted."""
        for name in ("admin_key", "read_key", "agent_token"):
            path: Path | None = getattr(self, f"{name}_file")
            flag = "--" + name.replace("_", "-")
            if path is not None:
                if getattr(self, name) is not None:
                    raise ValueError(f"give {flag} or {flag}-file, not both")
                setattr(self, name, read_secret(path, f"{flag}-file"))
            value = getattr(self, name)
            if value is not None:
                check_secret(value, flag)
        if exposed_without_auth(self.host, self.api_keys_file is not None, self.trusted_network):
            raise ValueError(
                f"refusing to serve {self.host} without client API keys: give --api-keys-file, or "
                "--trusted-network if every host that can reach this port may use the pool "
                "(docs/security.md)")
        return self

    @property
    def observability_guarded(self) -> bool:
        """Whether /metrics, /api/pool, its stream and the scale hint need the read or the admin key: once a
        read key is set, or once the router serves beyond loopback with any key."""
        keyed = self.api_keys_file is not None or self.admin_key is not None
        return self.read_key is not None or (keyed and not is_loopback(self.host))
