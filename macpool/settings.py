"""Settings loading shared by the router and the agent: flags > ``MACPOOL_*`` environment > TOML file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

S = TypeVar("S", bound=BaseSettings)


class ConfigError(ValueError):
    """A configuration value or file that cannot work; the message names the key and the value."""


def load_layered(cls: type[S], flags: dict[str, Any], config_file: Path | None, section: str) -> S:
    """Build ``cls`` from the flags, the environment and the ``[section]`` of ``config_file``."""
    file_values = read_toml_section(config_file, section) if config_file else {}
    try:
        return layered(cls, flags, file_values)
    except ValidationError as exc:
        raise ConfigError(first_error(exc)) from None


def layered(cls: type[S], flags: dict[str, Any], file_values: dict[str, Any]) -> S:
    """Build ``cls`` from the three sources; raises pydantic's ValidationError."""

    class _Layered(cls):  # type: ignore[valid-type, misc]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, InitSettingsSource(settings_cls, file_values)

    merged = _Layered(**{key: value for key, value in flags.items() if value is not None})
    return cls.model_validate(merged.model_dump())


def read_toml_section(path: Path, section: str) -> dict[str, Any]:
    """The keys of a TOML file's ``[section]`` table, or its top-level keys when it has none."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {str(path)!r}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {str(path)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {str(path)!r}: {exc}") from None
    values = data.get(section, data)
    if not isinstance(values, dict):
        raise ConfigError(f"--config {str(path)!r}: [{section}] must be a table")
    return {key.replace("-", "_"): value for key, value in values.items()}


def first_error(exc: ValidationError) -> str:
    """The first validation error as one line naming the key and the value."""
    error = exc.errors()[0]
    key = ".".join(str(part) for part in error["loc"]) or "settings"
    return f"invalid {key}={error.get('input')!r}: {error['msg']}"
