"""Settings layering shared by the router and the agent: flags > ``MACPOOL_*`` environment > TOML file."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

S = TypeVar("S", bound=BaseSettings)


def layered(cls: type[S], flags: dict[str, Any], file_values: dict[str, Any]) -> S:
    """Build ``cls`` from the three sources; raises pydantic's ValidationError for the caller to word."""

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
