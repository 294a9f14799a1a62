"""The agent's one settings object: flags > environment (``MACPOOL_*``) > TOML file (``--config``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, AliasChoices, BeforeValidator, Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    SettingsConfigDict,
)

from macpool.serving import check_tls_files
from macpool.settings import ConfigError, RedisUrl, UserPath, first_error, load_layered
from macpool.store import DEFAULT_PREFIX
from macpool.wol import BadMac, normalize_mac

ProbeKind = Literal["auto", "macos", "linux", "sim"]
# a model's name on a Mac of several (--models): its llama-server model id, and part of its node id and URL
MODEL_NAME = re.compile(r"^[A-Za-z0-9][\w.:-]*$")


def _model_files(value: object) -> object:
    """``NAME=FILE[,NAME=FILE...]`` (a flag, or MACPOOL_MODELS) -> {name: file}; a mapping passes as it is."""
    if not isinstance(value, str):
        return value
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"expected NAME=FILE.gguf[,NAME=FILE.gguf...], not {part!r}")
        if name.strip() in out:
            raise ValueError(f"names {name.strip()!r} twice")
        out[name.strip()] = path.strip()
    return out


ModelFiles = Annotated[dict[str, UserPath], NoDecode, BeforeValidator(_model_files)]


class AgentSettings(BaseSettings):
    """Everything `macpool agent run` needs, built once at the CLI edge and passed down."""

    model_config = SettingsConfigDict(env_prefix="MACPOOL_", extra="forbid", populate_by_name=True)

    # where llama-server is: attach to a running one, or supervise our own
    upstream: str | None = None
    llama_server: Annotated[str, AfterValidator(os.path.expanduser)] | None = None  # a path, or on PATH
    model: UserPath | None = None
    # several models on one Mac (node_agent/models.py): name -> GGUF file, served by llama-server's router
    # mode; given as NAME=FILE[,NAME=FILE...] on the command line or in the environment, a table in TOML
    models: ModelFiles = Field(default_factory=dict)
    parallel: int | None = Field(default=None, ge=1)  # None: the slots that fit (node_agent/sizing.py)
    # the most tokens (prompt and output) one request may hold: a slot's context. 32K holds a coding agent's
    # turn (its system prompt, tools and the history it re-sends)
    ctx_per_slot: int = Field(default=32768, ge=16)
    llama_args: list[str] = Field(default_factory=list)
    llama_log: UserPath | None = None

    # the pool
    redis_url: RedisUrl = "redis://127.0.0.1:6379/0"
    # (no whitespace: the pool's events and scripts list node ids separated by spaces and newlines)
    node_id: str = Field(default_factory=socket.gethostname, pattern=r"^\S+$")
    advertise_url: str | None = None
    key_prefix: str = DEFAULT_PREFIX
    heartbeat_interval: float = Field(default=1.0, gt=0)

    # the gateway
    host: str = "127.0.0.1"
    port: int = Field(default=8090, ge=0, le=65535)
    token: str | None = Field(default=None, validation_alias=AliasChoices("MACPOOL_AGENT_TOKEN"))
    # HTTPS (docs/security.md, "TLS"); with tls_client_ca, mutual TLS: routers show a certificate of that CA
    tls_cert: UserPath | None = None
    tls_key: UserPath | None = None
    tls_client_ca: UserPath | None = None
    connect_timeout: float = Field(default=5.0, gt=0)
    read_timeout: float = Field(default=600.0, gt=0)  # longest silence between two upstream chunks
    drain_timeout: float = Field(default=30.0, ge=0)
    request_read_timeout: float = Field(default=30.0, gt=0)  # to receive a request's body (408 past it)
    # light requests (token counts, templates, tokenize) in flight at once: they hold no generation slot, but
    # each holds a CPU core of the Mac and a thread of llama-server's while it is answered (docs/agent.md)
    light_cap: int = Field(default=8, ge=1)

    # honest capacity
    cap: int | None = Field(default=None, ge=0)
    calibration: UserPath | None = None
    calibrated_cap: int | None = Field(default=None, ge=0)
    calibrated_per_request_gb: float | None = Field(default=None, gt=0)
    headroom_gb: float = Field(default=2.0, ge=0)
    request_overhead_gb: float = Field(default=0.25, ge=0)
    memory_probe: ProbeKind = "auto"
    pressure_recover_beats: int = Field(default=3, ge=1)
    wired_limit_gb: float | None = Field(default=None, gt=0)  # to size llama-server by; None: the probe's
    shrink_after_beats: int = Field(default=10, ge=1)  # heartbeats of pressure before fewer slots
    restart_backoff_max: float = Field(default=30.0, gt=0)

    # the elastic pool (node_agent/standby.py): follow the autoscaler's active/standby word; start in standby
    elastic: bool = False
    standby: bool = False
    # ... and go back to standby after this long without a request (0: only when the autoscaler says so)
    idle_unload: float = Field(default=0.0, ge=0)
    wol_mac: str | None = None  # this Mac's MAC address, so the autoscaler can wake it from sleep
    wol_broadcast: str = "255.255.255.255"

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"

    @property
    def supervise(self) -> bool:
        return self.llama_server is not None

    @property
    def follows_autoscaler(self) -> bool:
        """Standby-capable: reads ``{p}desired:{id}`` on each heartbeat."""
        return self.elastic or self.standby

    @property
    def llama_command(self) -> list[str]:
        """``--llama-server`` as argv: a path, or a whole command line (shlex-split)."""
        return shlex.split(self.llama_server or "")

    @property
    def public_url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert is not None else "http"

    def check(self) -> None:
        """Fail before start, with one line naming the bad key, for anything that cannot work."""
        if (self.upstream is None) == (self.llama_server is None):
            raise ConfigError("give exactly one of --upstream URL (attach) or --llama-server CMD (supervise)")
        if self.upstream is not None:
            _check_http_url("--upstream", self.upstream)
        if self.advertise_url is not None:
            _check_http_url("--advertise-url", self.advertise_url)
        self._check_tls()
        if self.supervise:
            argv = self.llama_command
            if not argv:
                raise ConfigError("--llama-server is empty")
            if shutil.which(argv[0]) is None:
                raise ConfigError(f"--llama-server {argv[0]!r}: no such executable")
            if self.model is None and not self.models:
                raise ConfigError("--model FILE.gguf (or --models NAME=FILE,...) is required with "
                                  "--llama-server")
            if self.model is not None and self.models:
                raise ConfigError("give --model FILE.gguf or --models NAME=FILE,..., not both")
            for arg in self.llama_args:
                # llama-server takes the last --host/--port it is given, and these come after the agent's:
                # one would open it to the network past the cap and token, the other hide it from the agent
                if arg.partition("=")[0] in ("--host", "--port"):
                    raise ConfigError(
                        f"-- {arg}: the agent runs llama-server on 127.0.0.1 and a free port of its choosing"
                    )
        if self.wol_mac is not None:
            try:
                normalize_mac(self.wol_mac)
            except BadMac as exc:
                raise ConfigError(f"--wol-mac: {exc}") from None
        if self.models and not self.supervise:
            raise ConfigError("--models needs --llama-server: the agent runs llama-server's router mode")
        for name, path in self.models.items():
            if not MODEL_NAME.match(name):
                raise ConfigError(f"--models: {name!r} is not a model name (letters, digits, '.', '_', ':', "
                                  "'-'; a letter or digit first)")
            if not path.is_file():
                raise ConfigError(f"--models {name}={str(path)!r}: no such file")
        if self.model is not None and not self.model.is_file():
            raise ConfigError(f"--model {str(self.model)!r}: no such file")
        if self.calibration is not None and not self.calibration.is_file():
            raise ConfigError(f"--calibration {str(self.calibration)!r}: no such file")


    def _check_tls(self) -> None:
        if self.tls_cert is not None and self.tls_key is None:
            raise ConfigError("--tls-cert needs --tls-key (the certificate's private key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked "
                              "for over HTTPS")
        try:
            check_tls_files(self.tls_cert, self.tls_key, self.tls_client_ca,
                            ("--tls-cert", "--tls-key", "--tls-client-ca"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.tls_cert is not None and self.advertise_url is not None \
                and urlsplit(self.advertise_url).scheme != "https":
            raise ConfigError(f"--advertise-url {self.advertise_url!r}: the agent serves HTTPS (--tls-cert), "
                              "so routers reach it at https://")


def _check_http_url(flag: str, url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} {url!r}: expected http://host:port")
    try:
        _ = parts.port
    except ValueError as exc:
        raise ConfigError(f"{flag} {url!r}: bad port") from exc


def read_calibration(path: Path) -> dict[str, Any]:
    """A ``calibrate --json`` result, or a TOML file written by ``calibrate --write-config``."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--calibration {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"--calibration {str(path)!r}: not UTF-8 text") from None
    try:
        data: Any = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--calibration {str(path)!r}: not valid JSON/TOML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--calibration {str(path)!r}: expected an object")
    data = data.get("agent", data)
    cap = data.get("recommended_cap", data.get("calibrated_cap"))
    per_request = data.get("per_request_gb", data.get("calibrated_per_request_gb"))
    if cap is None and per_request is None:
        raise ConfigError(f"--calibration {str(path)!r}: has neither recommended_cap nor per_request_gb")
    out: dict[str, Any] = {}
    if cap is not None:
        out["calibrated_cap"] = cap
    if per_request:
        out["calibrated_per_request_gb"] = per_request
    return out


def load_settings(flags: dict[str, Any], config_file: Path | None = None) -> AgentSettings:
    """Merge the three sources (flags win, then ``MACPOOL_*``, then the file) and check the result."""
    settings = load_layered(AgentSettings, flags, config_file, "agent")
    for mode, other in (("upstream", "llama_server"), ("llama_server", "upstream")):
        if flags.get(mode) is not None and flags.get(other) is None:
            # one choice: --upstream or --llama-server on the command line wins over the other's setting in
            # the environment or the file (attaching to a test server with the Mac's usual config file)
            settings = settings.model_copy(update={other: None})
    if settings.calibration is not None:
        settings.check()
        calibrated = read_calibration(settings.calibration)
        explicit = {k for k in ("calibrated_cap", "calibrated_per_request_gb") if flags.get(k) is not None}
        update = {k: v for k, v in calibrated.items() if k not in explicit}
        try:  # validated like any other source (a copy with an update would take "x" or -5 as they are)
            settings = AgentSettings.model_validate({**settings.model_dump(), **update})
        except ValidationError as exc:
            raise ConfigError(f"--calibration {str(settings.calibration)!r}: {first_error(exc)}") from None
    settings.check()
    return settings
