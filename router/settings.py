"""The router's one settings object: defaults < TOML file < ``MACPOOL_*`` environment < command-line flags."""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from macpool.settings import ConfigError, Origins, RedisUrl, UserPath, load_layered
from macpool.store import DEFAULT_PREFIX
from router.aliases import AliasTable

__all__ = ["ConfigError", "Settings", "load_settings"]


def _default_router_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class Settings(BaseSettings):
    """Everything the router process is configured with (see docs/router.md for each knob)."""

    model_config = SettingsConfigDict(env_prefix="MACPOOL_", extra="forbid")

    redis_url: RedisUrl = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    key_prefix: str = DEFAULT_PREFIX
    router_id: str = Field(default_factory=_default_router_id)

    # admission
    queue_size: int = Field(default=64, ge=0)
    queue_timeout: float = Field(default=2.0, ge=0)
    # scale to zero (router/cold_start.py): how long a request waits for a standby node to load (0: 503 now)
    cold_start_timeout: float = Field(default=60.0, ge=0)
    # ... and asks the standby node of the model that loads it soonest to load it (once for every router)
    load_on_demand: bool = True
    lease_seconds: float = Field(default=30.0, gt=0)
    # a router that has not beaten for this long counts as dead: what it held is given back
    liveness_seconds: float = Field(default=4.0, gt=0)
    default_model: str = ""
    # names clients send for a model the pool serves: exact names, then glob patterns (router/aliases.py)
    model_aliases: AliasTable = Field(default_factory=dict)
    # light requests (token counts, templates) this router has in flight on one node at most (router/light.py)
    light_concurrency: int = Field(default=8, ge=1)

    # prefix-cache affinity (router/affinity.py): prefer the node that served a request's prompt prefix,
    # unless it is busier than the node placement chose by both thresholds (SGLang's rule)
    affinity: bool = True
    affinity_abs_threshold: int = Field(default=4, ge=0)
    affinity_rel_threshold: float = Field(default=1.5, ge=1.0)
    affinity_max_entries: int = Field(default=100_000, ge=1)

    # placement (router/placement.py): the node that would answer soonest, weighing what each node measured
    # (its TTFT and the decode speed of one slot) for an answer of placement_tokens, or least utilisation
    placement: Literal["fastest", "least-utilised"] = "fastest"
    placement_tokens: int = Field(default=256, ge=1)

    # priority classes and tenants (docs/router.md "Priorities, fairness and per-key limits")
    default_priority: Literal["interactive", "batch"] = "interactive"
    batch_queue_share: float = Field(default=0.25, ge=0.0, le=1.0)
    key_max_concurrency: int = Field(default=0, ge=0)

    # forwarding
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    request_read_timeout: float = Field(default=30.0, gt=0)
    connect_timeout: float = Field(default=2.0, gt=0)
    first_byte_timeout: float = Field(default=120.0, gt=0)
    # a non-streamed answer's first byte comes with its last: the whole generation is the wait
    response_timeout: float = Field(default=600.0, gt=0)
    idle_timeout: float = Field(default=60.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    agent_token: str = ""

    # pool view and passive health
    refresh_interval: float = Field(default=1.0, gt=0)
    stale_after: float = Field(default=5.0, gt=0)
    circuit_failures: int = Field(default=3, ge=1)
    circuit_cooldown: float = Field(default=5.0, ge=0)

    # auth
    api_keys_file: UserPath | None = None
    admin_key: str = ""
    # browser applications on these origins may call the API (CORS); "*" any, "" none (no CORS headers)
    cors_origins: Origins = ""

    # scale hint (router/scale.py): the Macs demand needs, between min and max, up when it passes the target
    # utilisation for up_delay seconds, down when it fits under the low one for down_delay; POSTed to the
    # webhook when it changes
    scale_target_utilisation: float = Field(default=0.8, gt=0, le=1)
    scale_low_utilisation: float = Field(default=0.5, gt=0, le=1)
    scale_up_delay: float = Field(default=10.0, ge=0)
    scale_down_delay: float = Field(default=120.0, ge=0)
    scale_min_nodes: int = Field(default=1, ge=0)
    scale_max_nodes: int = Field(default=64, ge=1)
    scale_webhook: str = ""

    @model_validator(mode="after")
    def _scale_bands(self) -> Settings:
        if self.scale_low_utilisation > self.scale_target_utilisation:
            raise ValueError(f"scale_low_utilisation ({self.scale_low_utilisation}) is over "
                             f"scale_target_utilisation ({self.scale_target_utilisation})")
        if self.scale_min_nodes > self.scale_max_nodes:
            raise ValueError(f"scale_min_nodes ({self.scale_min_nodes}) is over scale_max_nodes "
                             f"({self.scale_max_nodes})")
        return self

    # process
    shutdown_timeout: int = Field(default=15, ge=0)
    access_log: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"


def load_settings(overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build the settings: flags (``overrides``) beat ``MACPOOL_*`` env, which beats the TOML file."""
    return load_layered(Settings, overrides, config_file, "router")
