"""Settings loading shared by the router and the agent: flags > ``MACPOOL_*`` environment > TOML file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args
from urllib.parse import urlsplit

from pydantic import AfterValidator, ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsError

from macpool.store.connect import parse, redact

S = TypeVar("S", bound=BaseSettings)


class ConfigError(ValueError):
    """A configuration value or file that cannot work; the message names the key and the value."""


def _redis_url(url: str) -> str:
    """One of the forms macpool/store/connect.py takes; redis-py would take ``/abc`` as database 0 without a
    word."""
    parse(url)
    return url


RedisUrl = Annotated[str, AfterValidator(_redis_url)]


def _origins(value: str) -> str:
    """``*`` or comma-separated browser origins (scheme://host[:port]), which a browser sends exactly so."""
    for origin in filter(None, (o.strip() for o in value.split(","))):
        if origin == "*":
            continue
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or origin != f"{parts.scheme}://{parts.netloc}":
            raise ValueError(f"{origin!r} is not an origin: scheme://host[:port], no path or trailing slash "
                             "(https://chat.example.com), or *")
    return value


Origins = Annotated[str, AfterValidator(_origins)]


# a path a person wrote: ``~`` is their home directory, wherever it was given (a config file, the environment,
# a flag written --model=~/x, which no shell expands); load_layered anchors a config file's relative paths
UserPath = Annotated[Path, AfterValidator(Path.expanduser)]


def origin_list(value: str) -> list[str]:
    return [o for o in (o.strip() for o in value.split(",")) if o]


def load_layered(cls: type[S], flags: dict[str, Any], config_file: Path | None, section: str) -> S:
    """Build ``cls`` from the flags, the environment and the ``[section]`` of ``config_file``."""
    file_values = _anchored(cls, read_toml_section(config_file, section), config_file) if config_file else {}
    try:
        return layered(cls, flags, file_values)
    except ValidationError as exc:
        raise ConfigError(first_error(exc)) from None
    except SettingsError as exc:  # an environment variable pydantic-settings cannot decode
        raise ConfigError(f"{exc} (in the environment, a list setting is JSON: '[\"-t\", \"4\"]')") from None


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


def _anchored(cls: type[BaseSettings], values: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """A config file's relative paths are relative to the file, as its reader expects (not to wherever the
    process was started: launchd starts it in /)."""
    def resolved(value: str) -> str:
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else config_file.parent / path)

    out = dict(values)
    for key, value in values.items():
        field = cls.model_fields.get(key)
        if field is None or not _is_path(field.annotation):
            continue
        if isinstance(value, str) and value:
            out[key] = resolved(value)
        elif isinstance(value, dict):  # a table of paths (the agent's models)
            out[key] = {name: resolved(v) if isinstance(v, str) and v else v for name, v in value.items()}
    return out


def _is_path(annotation: Any) -> bool:
    """Whether a field's type is a path (Path, UserPath, either or None)."""
    return annotation is Path or any(_is_path(arg) for arg in get_args(annotation))


def read_toml_section(path: Path, section: str) -> dict[str, Any]:
    """The keys of a TOML file's ``[section]`` table, or its top-level keys when it has none."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {str(path)!r}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"--config {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {str(path)!r}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {str(path)!r}: {exc}") from None
    values = data.get(section, data)
    if not isinstance(values, dict):
        raise ConfigError(f"--config {str(path)!r}: [{section}] must be a table")
    return {key.replace("-", "_"): value for key, value in values.items()}


_SECRET_WORDS = ("token", "key", "password", "secret")


def first_error(exc: ValidationError) -> str:
    """The first validation error as one line naming the key and the value (never a secret's value)."""
    error = exc.errors()[0]
    key = ".".join(str(part) for part in error["loc"]) or "settings"
    if error["type"] == "extra_forbidden":
        return (f"unknown setting {key!r}: a misspelled key in the config file, or a "
                f"MACPOOL_{key.upper()} environment variable this command does not read")
    value = "***" if any(word in key.lower() for word in _SECRET_WORDS) else redact(repr(error.get("input")))
    return f"invalid {key}={value}: {error['msg']}"
