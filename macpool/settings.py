"""What every command's settings share: one declaration per setting gives its flag, its ``MACPOOL_*`` variable
and its key in a ``--config`` TOML file. Flags beat the environment, which beats the file, which beats the
defaults.

A command's settings model subclasses :class:`CommandSettings`; ``Model.from_argv(argv)`` is its command line.
pydantic-settings makes the flags (kebab-case, ``--x/--no-x`` for a switch, each with its help, default and
variable), reads the environment, and :class:`ConfigFile` reads the file the settings name.
"""

from __future__ import annotations

import ipaddress
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self, TypeVar, get_args
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from macpool.hub import parse_ref
from macpool.store.connect import parse, redact

S = TypeVar("S", bound=BaseSettings)
JSON_LIST = """'["-t", "4"]'"""  # how a list setting is written in the environment


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


def _hosts(value: str) -> str:
    """Comma-separated host names (``macpool.lan``; ``*.example.com``: any name under it), no port."""
    for host in filter(None, (h.strip() for h in value.split(","))):
        name = host.removeprefix("*.")
        if not name or any(c in name for c in "/:*@ []") or name.startswith(".") or name.endswith("."):
            raise ValueError(f"{host!r} is not a host name: a name (macpool.lan) or *.domain "
                             "(*.example.com), without scheme or port")
    return value


Hosts = Annotated[str, AfterValidator(_hosts)]


def network_list(value: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Comma-separated CIDRs (``10.0.0.0/8,fc00::/7``; a bare address is its own /32 or /128)."""
    networks = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not a network: an address or address/prefix (192.168.0.0/16)") \
                from None
    if not networks:
        raise ValueError("no network given")
    return networks


def _networks(value: str) -> str:
    network_list(value)
    return value


Networks = Annotated[str, AfterValidator(_networks)]


# a path a person wrote: ``~`` is their home directory, wherever it was given (a config file, the environment,
# a flag written --model=~/x, which no shell expands); ConfigFile anchors a config file's relative paths
UserPath = Annotated[Path, AfterValidator(Path.expanduser)]


def origin_list(value: str) -> list[str]:
    return [o for o in (o.strip() for o in value.split(",")) if o]


class CommandSettings(BaseSettings):
    """Settings of one command, from its flags, the ``MACPOOL_*`` environment and a ``--config`` file."""

    model_config = SettingsConfigDict(
        env_prefix="MACPOOL_",
        env_prefix_target="all",  # an alias names its variable too: MACPOOL_<alias>
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,  # a switch is --x and --no-x, so a flag can undo the file or the environment
        cli_hide_none_type=True,
        cli_avoid_json=True,
        cli_show_env_vars=True,
        cli_parse_none_str="unset",
    )
    # the table of a --config file this command reads, when the file has one (else its top-level keys)
    config_table: ClassVar[str]

    config: UserPath | None = Field(
        default=None,
        description="TOML file of settings: the command's own table ([router], [agent], [autoscale]) or "
        "top-level keys; a relative path in it is relative to the file; flags and MACPOOL_* variables win",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # pydantic-settings puts the command line, when given, before all of these
        return init_settings, env_settings, ConfigFile(settings_cls, cls.config_table)

    @classmethod
    def from_argv(cls, argv: list[str], flags: CliSettingsSource[Any] | None = None, **init: Any) -> Self:
        """The settings of ``<command> argv``: its flags (parsed into ``flags``, when given, which then tells
        what they set), then ``init``, the environment and the config file. ``--help`` prints and exits 0, an
        unknown flag exits 2; a bad value raises ConfigError."""
        return from_argv(cls, argv, flags, **init)


def from_argv(cls: type[S], argv: list[str], flags: CliSettingsSource[Any] | None = None, **init: Any) -> S:
    """``cls`` from the command line ``argv`` and whatever other sources ``cls`` names (see
    :meth:`CommandSettings.from_argv`); a bad value raises ConfigError, one line naming it."""
    try:
        return CliApp.run(cls, cli_args=argv, cli_settings_source=flags, **init)
    except ValidationError as exc:
        raise ConfigError(first_error(exc)) from None
    except SettingsError as exc:  # a value pydantic-settings cannot split or decode
        raise ConfigError(f"{exc} (in the environment, a list setting is JSON: {JSON_LIST})") from None


class ConfigFile(PydanticBaseSettingsSource):
    """The settings in the TOML file that the sources before this one named (``config``): its ``[table]``, or
    its top-level keys when it has none. A relative path in it is relative to the file, as its reader expects
    (not to wherever the process was started: launchd starts it in /)."""

    def __init__(self, settings_cls: type[BaseSettings], table: str) -> None:
        super().__init__(settings_cls)
        self.table = table

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError("a config file is read whole")  # pydantic-settings calls __call__ only

    def __call__(self) -> dict[str, Any]:
        named = self.current_state.get("config")
        if not named:
            return {}
        path = Path(named).expanduser()
        values = read_toml_table(path, self.table)
        if "config" in values:
            raise ConfigError(f"--config {str(path)!r}: a config file cannot name another (config = ...)")
        return InitSettingsSource(self.settings_cls, _anchored(self.settings_cls, values, path))()


def read_toml_table(path: Path, table: str) -> dict[str, Any]:
    """The keys of a TOML file's ``[table]``, or its top-level keys when it has none (``-`` read as ``_``)."""
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
    values = data.get(table, data)
    if not isinstance(values, dict):
        raise ConfigError(f"--config {str(path)!r}: [{table}] must be a table")
    return {key.replace("-", "_"): value for key, value in values.items()}


def _anchored(cls: type[BaseSettings], values: dict[str, Any], config_file: Path) -> dict[str, Any]:
    """``values`` with each relative path made relative to ``config_file``'s folder (a Hugging Face
    reference where a model's file may be given is left as it is)."""
    def resolved(value: str, source: bool) -> str:
        if source and not value.startswith(".") and parse_ref(value) is not None:
            return value
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else config_file.parent / path)

    def keys(marker: object) -> set[str]:
        return {key for name, field in cls.model_fields.items() if _marked(field.annotation, marker)
                for key in (name, field.validation_alias) if isinstance(key, str)}

    paths, sources = keys(Path), keys(PATH_OR_REF)
    out = dict(values)
    for key, value in values.items():
        if key not in paths | sources:
            continue
        if isinstance(value, str) and value:
            out[key] = resolved(value, key in sources)
        elif isinstance(value, dict):  # a table of paths (the agent's models)
            out[key] = {name: resolved(v, key in sources) if isinstance(v, str) and v else v
                        for name, v in value.items()}
    return out


def _marked(annotation: Any, marker: object) -> bool:
    """Whether a field's type is ``marker`` (Path; a model's source), either or None, a table of them."""
    return annotation is marker or any(_marked(arg, marker) for arg in get_args(annotation))


class _PathOrRef:
    """Marks a setting holding a model's GGUF file or its Hugging Face reference (macpool/hub.py), as text:
    a path in a config file is the file's, like any path; a reference is left as it is."""


PATH_OR_REF = _PathOrRef()


_SECRET_WORDS = ("token", "key", "password", "secret")


def first_error(exc: ValidationError) -> str:
    """The first validation error as one line naming the key and the value (never a secret's value)."""
    error = exc.errors()[0]
    key = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if not key:  # a rule between settings: its message names them, and the input is every setting
        return message
    if error["type"] == "missing":
        return f"--{key.replace('_', '-')} is required"
    if error["type"] == "extra_forbidden":
        return (f"unknown setting {key!r}: a misspelled key in the config file, or a "
                f"MACPOOL_{key.upper()} environment variable this command does not read")
    value = "***" if any(word in key.lower() for word in _SECRET_WORDS) else redact(repr(error.get("input")))
    return f"invalid {key}={value}: {message}"
