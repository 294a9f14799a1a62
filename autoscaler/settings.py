"""The autoscaler's one settings object: flags > environment (``MACPOOL_*``) > TOML file (``[autoscale]``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from macpool import wol
from macpool.settings import ConfigError, RedisUrl, load_layered
from macpool.store import DEFAULT_PREFIX

from .controller import ControllerConfig
from .policy import PolicyConfig


class AutoscaleSettings(BaseSettings):
    """Everything `macpool autoscale` needs, built once at the CLI edge and passed down."""

    model_config = SettingsConfigDict(env_prefix="MACPOOL_", extra="forbid", populate_by_name=True)

    redis_url: RedisUrl = "redis://127.0.0.1:6379/0"
    key_prefix: str = DEFAULT_PREFIX
    interval: float = Field(default=1.0, gt=0)
    lease: float = Field(default=5.0, gt=0)
    target_utilisation: float = Field(default=0.8, gt=0, le=1)
    low_utilisation: float = Field(default=0.5, gt=0, le=1)
    up_delay: float = Field(default=10.0, ge=0)
    down_delay: float = Field(default=120.0, ge=0)
    cooldown: float = Field(default=30.0, ge=0)
    min_nodes: int = Field(default=0, ge=0)
    max_nodes: int = Field(default=64, ge=1)
    wake_timeout: float = Field(default=120.0, gt=0)
    wol_port: int = Field(default=wol.DEFAULT_PORT, ge=1, le=65535)
    controller_id: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"

    def check(self) -> None:
        if self.low_utilisation >= self.target_utilisation:
            raise ConfigError(
                f"--low-utilisation {self.low_utilisation} must be below --target-utilisation "
                f"{self.target_utilisation}, or the pool flaps"
            )
        if self.min_nodes > self.max_nodes:
            raise ConfigError(f"--min-nodes {self.min_nodes} is above --max-nodes {self.max_nodes}")
        if self.lease <= self.interval:
            raise ConfigError(f"--lease {self.lease} must be longer than --interval {self.interval}")

    def controller(self) -> ControllerConfig:
        policy = PolicyConfig(
            target_utilisation=self.target_utilisation, low_utilisation=self.low_utilisation,
            up_delay_s=self.up_delay, down_delay_s=self.down_delay, cooldown_s=self.cooldown,
            min_nodes=self.min_nodes, max_nodes=self.max_nodes,
        )
        config = ControllerConfig(policy=policy, interval_s=self.interval, lease_s=self.lease,
                                  wake_timeout_s=self.wake_timeout, wol_port=self.wol_port)
        if self.controller_id:
            config.controller_id = self.controller_id
        return config


def load_settings(flags: dict[str, Any], config_file: Path | None = None) -> AutoscaleSettings:
    settings = load_layered(AutoscaleSettings, flags, config_file, "autoscale")
    settings.check()
    return settings
