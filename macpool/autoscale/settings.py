"""The autoscaler's one settings object, and its command line (``macpool autoscale``): flags > ``MACPOOL_*``
environment > ``--config`` TOML file (top-level keys or an ``[autoscale]`` table) > defaults."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from macpool import wol
from macpool.scaling import ScalePolicy
from macpool.settings import CommandSettings, RedisUrl
from macpool.store import DEFAULT_PREFIX

from .controller import ControllerConfig


class AutoscaleSettings(ScalePolicy, CommandSettings):
    """
    Act on the pool's demand: activate standby Macs (and wake sleeping ones with Wake-on-LAN) when it exceeds
    ready capacity, send them back to standby when it stays low. Run two for high availability: one leads (a
    lease in Redis), the other takes over. The scaling policy's knobs come first.
    """

    model_config = SettingsConfigDict(cli_prog_name="macpool autoscale")
    config_table = "autoscale"

    redis_url: RedisUrl = Field(default="redis://127.0.0.1:6379/0", description="the pool's Redis")
    key_prefix: str = Field(
        default=DEFAULT_PREFIX, description="Redis key prefix (as the routers' and agents')"
    )
    interval: float = Field(default=1.0, gt=0, description="seconds between two looks at the pool")
    lease: float = Field(default=5.0, gt=0, description="leader lease, seconds (longer than the interval)")
    cooldown: float = Field(default=30.0, ge=0, description="seconds after any action before a scale-down")
    wake_timeout: float = Field(
        default=120.0, gt=0,
        description="seconds a Mac told to load (or woken) has to come back before it is told again",
    )
    wol_port: int = Field(
        default=wol.DEFAULT_PORT, ge=1, le=65535, description="UDP port of the magic packets"
    )
    controller_id: str | None = Field(
        default=None,
        description="this controller's id in the lease and the events (unset: the host name and a random "
        "suffix)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one JSON object per line"
    )

    @model_validator(mode="after")
    def _lease_outlasts_a_look(self) -> Self:
        if self.lease <= self.interval:
            raise ValueError(f"lease ({self.lease}) must be longer than interval ({self.interval})")
        return self

    def controller(self) -> ControllerConfig:
        config = ControllerConfig(
            policy=self.policy(), cooldown_s=self.cooldown, interval_s=self.interval, lease_s=self.lease,
            wake_timeout_s=self.wake_timeout, wol_port=self.wol_port,
        )
        if self.controller_id:
            config.controller_id = self.controller_id
        return config
