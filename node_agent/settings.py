"""The agent's one settings object, and its command line (``macpool agent run``): flags > ``MACPOOL_*``
environment > ``--config`` TOML file (top-level keys or an ``[agent]`` table) > defaults."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import tomllib
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    CliSuppress,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from macpool.contract import MODEL_NAME
from macpool.credentials import SecretError, check_secret, exposed_without_auth, read_secret
from macpool.hub import HubRef, model_source
from macpool.identity import IdentityError, NodeCredential, load_credential
from macpool.serving import check_tls_files
from macpool.settings import PATH_OR_REF, CommandSettings, ConfigError, RedisUrl, UserPath, first_error
from macpool.store import DEFAULT_PREFIX
from macpool.wol import normalize_mac

ProbeKind = Literal["auto", "macos", "linux", "sim"]


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected http://host:port")
    _ = parts.port  # ValueError for a port that is not a number in range
    return url


def _executable(command: str) -> str:
    """A path or a command line whose program is there to run."""
    argv = shlex.split(command)
    if not argv:
        raise ValueError("empty: the path or command line of llama-server")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"{argv[0]!r}: no such executable")
    return command


def _a_file(path: Path) -> Path:
    if not path.is_file():
        raise ValueError("no such file")
    return path


def _model_name(name: str) -> str:
    if not MODEL_NAME.match(name):
        raise ValueError(f"{name!r} is not a model name (letters, digits, '.', '_', ':', '-'; a letter or "
                         "digit first)")
    return name


def _source(text: str) -> str:
    """A GGUF file that is there (``~`` is the home directory) or a Hugging Face reference (macpool/hub.py),
    as text: the path, or the reference as the hub module writes it."""
    source = model_source(text)
    if isinstance(source, HubRef):
        return str(source)
    if not source.is_file():
        raise ValueError("no such file (nor a Hugging Face reference: org/repo:QUANT or org/repo/file.gguf)")
    return str(source)


def _model_files(value: object) -> object:
    """``NAME=SOURCE[,NAME=SOURCE...]`` (a flag, or MACPOOL_MODELS) -> {name: source}; a mapping passes as it
    is."""
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


def _mac(mac: str) -> str:
    normalize_mac(mac)  # BadMac (a ValueError) names what is wrong
    return mac


HttpUrl = Annotated[str, AfterValidator(_http_url)]
# a path, or a whole command line: ``~`` is the home directory
LlamaServer = Annotated[str, AfterValidator(os.path.expanduser), AfterValidator(_executable)]
# a file that must be there: ``~`` is the home directory, and a config file's relative path is the file's
ExistingFile = Annotated[UserPath, AfterValidator(_a_file)]
# where a model comes from: a GGUF file, or a model on Hugging Face, downloaded before it is served; text,
# so that the command line takes it as one value
ModelSource = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, PurePath) else v),
                        AfterValidator(_source), PATH_OR_REF]
ModelFiles = Annotated[
    dict[Annotated[str, AfterValidator(_model_name)], ModelSource], NoDecode, BeforeValidator(_model_files)
]


class AgentSettings(CommandSettings):
    """
    Run the node agent: a capped local gateway in front of llama-server, heartbeats into Redis. Arguments
    after `--` go to llama-server unchanged.
    """

    model_config = SettingsConfigDict(
        cli_prog_name="macpool agent run", cli_shortcuts={"model": "m"}, populate_by_name=True
    )
    config_table = "agent"

    # where llama-server is: attach to a running one, or supervise our own (exactly one)
    upstream: HttpUrl | None = Field(
        default=None, description="attach: URL of a running llama-server (or `macpool sim`)"
    )
    llama_server: LlamaServer | None = Field(
        default=None, description="supervise: llama-server's path or command line (split as a shell would)"
    )
    model: ModelSource | None = Field(
        default=None,
        description="the GGUF file, or a Hugging Face model (org/repo:QUANT as llama.cpp's -hf, or "
        "org/repo/file.gguf), downloaded into the Hugging Face cache before llama-server starts (required "
        "to supervise; sizes the KV cache)",
    )
    models: ModelFiles = Field(
        default={},
        description="several models on this Mac instead of --model: NAME=SOURCE[,NAME=SOURCE...] (a table in "
        "TOML), each SOURCE a GGUF file or a Hugging Face model, served by llama-server's router mode, "
        "loaded on demand under one memory budget (each is a pool node <node-id>/<NAME>)",
    )
    from_pool: bool = Field(
        default=False,
        description="also serve the models the pool declares (`macpool models add`) that fit this Mac's "
        "memory budget: downloaded from Hugging Face, served as with --models (docs/models.md)",
    )
    parallel: int | None = Field(
        default=None, ge=1,
        description="llama-server slots (supervise; unset: the slots whose KV cache fits the memory budget "
        "at --ctx-per-slot, bounded by the calibrated cap; fewer after persistent memory pressure)",
    )
    ctx_per_slot: int = Field(
        default=32768, ge=16,
        description="the most tokens (prompt and output) one request may hold: each slot's context (32K "
        "holds a coding agent's turn); the slots that fit are sized at it",
    )
    # the arguments after `--` (a list in TOML, JSON in the environment): no flag of its own
    llama_args: CliSuppress[list[str]] = Field(
        default=[], description="supervise: llama-server's arguments after the agent's; attach: the ones the "
        "attached llama-server was started with, for its KV cache"
    )
    llama_log: UserPath | None = Field(default=None, description="append llama-server's output to this file")

    # the pool
    redis_url: RedisUrl = Field(
        default="redis://127.0.0.1:6379/0",
        description="the pool's Redis: redis://, rediss://, unix://, redis+sentinel:// or redis+cluster://",
    )
    # (no whitespace: the pool's events and scripts list node ids separated by spaces and newlines)
    node_id: str = Field(
        default_factory=socket.gethostname, pattern=r"^\S+$", description="the node's id in the pool"
    )
    advertise_url: HttpUrl | None = Field(
        default=None,
        description="how routers reach this agent (unset: http://<host>:<port>; https:// with --tls-cert)",
    )
    key_prefix: str = Field(default=DEFAULT_PREFIX, description="Redis key prefix (as the routers')")
    heartbeat_interval: float = Field(default=1.0, gt=0, description="seconds between heartbeats")

    # the gateway
    host: str = Field(default="127.0.0.1", description="listen address (0.0.0.0 to serve the LAN)")
    port: int = Field(default=8090, ge=0, le=65535, description="listen port")
    token: str | None = Field(
        default=None, validation_alias="agent_token",  # the router's setting of the same token
        description="require this token in X-Macpool-Token (prefer --token-file or MACPOOL_AGENT_TOKEN: a "
        "flag shows in ps)",
    )
    token_file: UserPath | None = Field(
        default=None, validation_alias="agent_token_file",
        description="file holding the agent token, its first line (the routers' --agent-token-file)",
    )
    trusted_network: bool = Field(
        default=False,
        description="serve beyond loopback with no token: every host that reaches the port is trusted "
        "(without it such an agent refuses to start; docs/security.md)",
    )
    node_credential: UserPath | None = Field(
        default=None,
        description="this node's credential file (`macpool node add ID`, mode 600): signs the heartbeats and "
        "replaces --token with this node's own token; the node id is the credential's",
    )
    # HTTPS (docs/security.md, "TLS"); with tls_client_ca, mutual TLS: routers show a certificate of that CA
    tls_cert: UserPath | None = Field(
        default=None,
        description="serve HTTPS with this certificate chain (PEM; with --tls-key): the node URL becomes "
        "https://",
    )
    tls_key: UserPath | None = Field(default=None, description="the private key of --tls-cert (PEM)")
    tls_client_ca: UserPath | None = Field(
        default=None,
        description="require every client (the routers) to show a certificate of this CA: mutual TLS",
    )
    connect_timeout: float = Field(default=5.0, gt=0, description="seconds to connect to llama-server")
    read_timeout: float = Field(
        default=600.0, gt=0,
        description="longest silence of llama-server, seconds (between chunks, or before a non-streamed "
        "answer)",
    )
    drain_timeout: float = Field(
        default=30.0, ge=0, description="longest wait for in-flight requests on SIGTERM, seconds"
    )
    request_read_timeout: float = Field(
        default=30.0, gt=0, description="seconds a client may take to send a request's body, then 408"
    )
    # light requests hold no generation slot, but each holds a CPU core of the Mac and a thread of
    # llama-server's while it is answered (docs/agent.md)
    light_cap: int = Field(
        default=8, ge=1,
        description="token counts, templates and tokenizations in flight at once, 503 node_full above",
    )
    session_ttl: float = Field(
        default=300.0, ge=0,
        description="seconds a coding-agent session that sent no turn still owns its llama-server slot: a "
        "new session takes an ended session's slot before a live one's (node_agent/slots.py)",
    )

    # honest capacity
    cap: int | None = Field(
        default=None, ge=0,
        description="configured cap, never above llama-server's total_slots (unset: total_slots)",
    )
    calibration: ExistingFile | None = Field(
        default=None, description="a `calibrate --json` result or a --write-config file"
    )
    calibrated_cap: int | None = Field(default=None, ge=0, description="the calibrated cap, directly")
    calibrated_per_request_gb: float | None = Field(
        default=None, gt=0, description="the measured per-request working set, GB, directly"
    )
    headroom_gb: float = Field(default=2.0, ge=0, description="GB kept free under the wired limit")
    host_reserve_gb: float = Field(
        default=8.0, ge=0,
        description="GB of RAM left to macOS and the Mac's other programs when sizing llama-server's prompt "
        "cache in host memory (--cache-ram: the RAM its weights, KV cache, headroom and this leave)",
    )
    request_overhead_gb: float = Field(
        default=0.25, ge=0,
        description="per-request working set beyond the KV cache, GB, for the GGUF estimate",
    )
    memory_probe: ProbeKind = Field(
        default="auto", description="where memory figures come from (auto: the upstream's /sim/memory if it "
        "has one, else this OS)"
    )
    pressure_recover_beats: int = Field(
        default=3, ge=1, description="calm heartbeats before memory pressure lets go"
    )
    wired_limit_gb: float | None = Field(
        default=None, gt=0,
        description="the GPU wired-memory limit llama-server's slots are sized for (unset: the memory "
        "probe's)",
    )
    shrink_after_beats: int = Field(
        default=10, ge=1,
        description="heartbeats of memory pressure before a supervised llama-server restarts with a quarter "
        "fewer slots (only when the agent chose the slots)",
    )
    restart_backoff_max: float = Field(
        default=30.0, gt=0, description="longest wait between llama-server restarts, seconds"
    )

    # the elastic pool (node_agent/standby.py)
    elastic: bool = Field(
        default=False, description="follow the autoscaler: load the model or go to standby when it says so"
    )
    standby: bool = Field(
        default=False,
        description="start in standby (implies --elastic): registered, model not loaded, admitting nothing",
    )
    idle_unload: float = Field(
        default=0.0, ge=0,
        description="seconds without a request after which the node unloads its model and goes back to "
        "standby by itself (0: only when the autoscaler says so)",
    )
    wol_mac: Annotated[str, AfterValidator(_mac)] | None = Field(
        default=None, description="this Mac's MAC address, so that the autoscaler can wake it from sleep"
    )
    wol_broadcast: str = Field(
        default="255.255.255.255", description="broadcast address of its LAN, for the magic packet"
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="log level")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one JSON object per line (uvicorn's lines too)"
    )

    @model_validator(mode="after")
    def _one_llama_server(self) -> Self:
        """A llama-server to attach to or one to supervise, with what supervising it needs."""
        if (self.upstream is None) == (self.llama_server is None):
            raise ValueError("give exactly one of --upstream URL (attach) or --llama-server CMD (supervise)")
        if self.multi_model and not self.supervise:
            flag = "--models" if self.models else "--from-pool"
            raise ValueError(f"{flag} needs --llama-server: the agent runs llama-server's router mode")
        if not self.supervise:
            return self
        if self.model is None and not self.multi_model:
            raise ValueError("--model FILE.gguf|org/repo:QUANT (or --models NAME=SOURCE,..., or --from-pool) "
                             "is required with --llama-server")
        if self.model is not None and self.multi_model:
            raise ValueError("give --model, or --models NAME=SOURCE,... and/or --from-pool, not both")
        for arg in self.llama_args:
            # llama-server takes the last --host/--port it is given, and these come after the agent's: one
            # would open it to the network past the cap and token, the other hide it from the agent
            if arg.partition("=")[0] in ("--host", "--port"):
                raise ValueError(f"-- {arg}: the agent runs llama-server on 127.0.0.1 and a free port of its "
                                 "choosing")
        return self

    @model_validator(mode="after")
    def _tls_files(self) -> Self:
        if self.tls_cert is not None and self.tls_key is None:
            raise ValueError("--tls-cert needs --tls-key (the certificate's private key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key: client certificates are asked "
                             "for over HTTPS")
        check_tls_files(self.tls_cert, self.tls_key, self.tls_client_ca,
                        ("--tls-cert", "--tls-key", "--tls-client-ca"))
        if self.tls_cert is not None and self.advertise_url is not None \
                and urlsplit(self.advertise_url).scheme != "https":
            raise ValueError(f"--advertise-url {self.advertise_url!r}: the agent serves HTTPS (--tls-cert), "
                             "so routers reach it at https://")
        return self

    @model_validator(mode="before")
    @classmethod
    def _node_id_of_credential(cls, data: Any) -> Any:
        """With a credential and no node id given, the node is the one the credential was issued for."""
        if isinstance(data, dict) and data.get("node_credential") and not data.get("node_id"):
            with contextlib.suppress(IdentityError):  # (check() says what is wrong with the file)
                credential = load_credential(Path(data["node_credential"]).expanduser())
                data = {**data, "node_id": credential.node_id}
        return data

    @model_validator(mode="after")
    def _one_way_to_authenticate(self) -> Self:
        """A shared token (given, or read from its file) or this node's own credential, the credential issued
        for this node; and one of them unless the agent serves loopback only or a trusted network."""
        if self.token_file is not None and self.token is not None:
            raise ValueError("give --token or --token-file, not both")
        if self.token is not None:
            try:
                check_secret(self.token, "--token")
            except SecretError as exc:
                raise ValueError(str(exc)) from None
        guarded = self.token is not None or self.token_file is not None or self.node_credential is not None
        if exposed_without_auth(self.host, guarded, self.trusted_network):
            raise ValueError(
                f"refusing to serve {self.host} without an agent token: give --token-file (the routers' "
                "--agent-token-file) or --node-credential, or --trusted-network if every host that can reach "
                "this port may use it (docs/security.md)")
        if self.node_credential is None:
            return self
        try:
            credential = load_credential(self.node_credential)
        except IdentityError as exc:
            raise ValueError(f"--node-credential: {exc}") from None
        if self.token:
            raise ValueError("give --token (a token shared by the pool) or --node-credential (this node's "
                             "own), not both")
        if credential.node_id != self.node_id:
            raise ValueError(f"--node-id {self.node_id!r}, but --node-credential was issued for "
                             f"{credential.node_id!r}")
        return self

    def with_token_read(self) -> AgentSettings:
        """These settings with ``--token-file``'s token read into ``token``: at start, not while settings are
        only checked (a configuration names a file of the Mac it runs on)."""
        if self.token_file is None:
            return self
        try:
            token = check_secret(read_secret(self.token_file, "--token-file"), "--token-file")
        except SecretError as exc:
            raise ConfigError(str(exc)) from None
        return self.model_copy(update={"token": token})

    def router_token(self) -> str | None:
        """What a router must send in X-Macpool-Token: this node's own token when it has a credential, else
        the shared one (None: nothing asked)."""
        credential = self.credential()
        return credential.agent_token if credential is not None else self.token

    def credential(self) -> NodeCredential | None:
        """This node's credential (``--node-credential``), or None."""
        if self.node_credential is None:
            return None
        try:
            return load_credential(self.node_credential)
        except IdentityError as exc:
            raise ConfigError(f"--node-credential: {exc}") from None

    @property
    def model_file(self) -> Path | None:
        """``model`` as a file: a Hugging Face reference is downloaded before the agent starts
        (node_agent/hub.py ``fetch_models``), so by then none is left."""
        return None if self.model is None else _file(self.model)

    @property
    def model_files(self) -> dict[str, Path]:
        """``models`` as files (``model_file``)."""
        return {name: _file(source) for name, source in self.models.items()}

    @property
    def multi_model(self) -> bool:
        """llama-server's router mode: several models (``--models``), or those of the pool."""
        return bool(self.models) or self.from_pool

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


def _file(source: str) -> Path:
    found = model_source(source)
    if isinstance(found, HubRef):
        raise RuntimeError(f"model {found} was not downloaded")
    return found


def _writable(path: Path) -> Path:
    """A file the command can write at its end: a check now, not after minutes of measuring."""
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"{str(folder)!r} is not a writable directory")
    if path.exists() and (path.is_dir() or not os.access(path, os.W_OK)):
        raise ValueError("not a writable file")
    return path


def _toml_or_new(path: Path) -> Path:
    """The calibrated keys are placed by the file's tables: a file that does not parse must say so now."""
    if path.exists():
        try:
            tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a TOML file ({exc})") from None
    return path


WritableFile = Annotated[UserPath, AfterValidator(_writable)]


class CalibrateSettings(BaseSettings):
    """
    Drive concurrency up in steps and recommend the cap: the smaller of the memory knee and the throughput
    knee (the smallest level reaching 95% of the best throughput). Exits 1 when no level is safe.
    """

    # flags only: a one-off measurement, and MACPOOL_MODEL (the agent's GGUF file) is no model name
    model_config = SettingsConfigDict(
        cli_prog_name="macpool agent calibrate", cli_kebab_case=True, cli_hide_none_type=True,
        cli_avoid_json=True, cli_parse_none_str="unset", extra="forbid",
    )

    upstream: HttpUrl = Field(description="llama-server (or `macpool sim`) URL")
    prompt_tokens: int | None = Field(
        default=None, ge=1,
        description="prompt length (unset: near the context one request may hold on the server - its "
        "slots' context less --max-tokens - the requests the Mac is sized for)",
    )
    max_tokens: int = Field(default=1024, ge=1, description="generated tokens per request")
    max_concurrency: int = Field(default=24, ge=1, description="highest level tried")
    step: int = Field(default=1, ge=1, description="between two levels")
    levels: list[Annotated[int, Field(ge=1)]] = Field(
        default=[], description="explicit comma-separated concurrency levels instead of 1..max by step"
    )
    window: int = Field(default=0, ge=0, description="requests measured per level (0: max(16, 6 x level))")
    max_p50_ratio: float | None = Field(
        default=None, gt=1,
        description="latency bound: the cap is the largest level whose p50 is at most this many times the "
        "first level's (instead of the throughput knee; memory and errors still bound it)",
    )
    max_ttft: float | None = Field(
        default=None, gt=0, description="latency bound: the largest level whose TTFT p50 is at most this (s)"
    )
    model: str | None = Field(default=None, description="model name to send (unset: the server's)")
    json_file: WritableFile | None = Field(
        default=None, validation_alias="json",
        description="write the result (recommended_cap, per_request_gb, rows)",
    )
    plot: WritableFile | None = Field(
        default=None, description="draw throughput, p50 and pinned memory curves (PNG)"
    )
    write_config: Annotated[WritableFile, AfterValidator(_toml_or_new)] | None = Field(
        default=None, description="store calibrated_cap in this agent TOML config"
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
        return (init_settings,)  # pydantic-settings puts the command line before it


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


def calibrated(settings: AgentSettings, flags: set[str]) -> AgentSettings:
    """``settings`` with the figures of its calibration file, but for those the ``flags`` gave."""
    if settings.calibration is None:
        return settings
    update = {k: v for k, v in read_calibration(settings.calibration).items() if k not in flags}
    try:  # validated like any other source (a copy with an update would take "x" or -5 as they are)
        return AgentSettings.model_validate({**settings.model_dump(), **update})
    except ValidationError as exc:
        raise ConfigError(f"--calibration {str(settings.calibration)!r}: {first_error(exc)}") from None
