"""The models a router-mode simulator serves, from ``--models NAME=PRESET,...`` or from llama-server's
model-preset INI file (``--models-preset FILE.ini``): each as its figures on the router's Mac, and the slots
and context its child server is started with."""

from __future__ import annotations

import configparser
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from macpool.gguf_info import GGUFError, read_shape
from macpool.sim.machine import Machine, MachineError, load_machine, load_preset
from macpool.sim.settings import SimSettings

# the figures of a Mac, not of a model: a model's figures are put on the router's Mac with these
MAC_FIELDS = ("total_gb", "wired_limit_gb", "near_ceiling_fraction", "paging_scale_gb", "paging_exponent",
              "collapse_overflow_gb", "overcommit", "load_gb_s")
GLOBAL_SECTION = "*"  # llama-server's section of settings every model takes unless its own section overrides
# configparser needs a section before any key: the file's top-level keys (``version = 1``) are read into this
TOP_LEVEL = "macpool: top-level keys"
NO_DEFAULTS = "\0"  # configparser's DEFAULT section would merge by key, not by argument: no file names this
# the preset keys the simulator reads, as llama-server accepts them (long and short argument names, and the
# environment variable, lowercased as configparser reads keys) -> the long name
ARGUMENTS = {
    "model": "model", "m": "model", "llama_arg_model": "model",
    "parallel": "parallel", "np": "parallel", "n-parallel": "parallel", "llama_arg_n_parallel": "parallel",
    "ctx-size": "ctx-size", "c": "ctx-size", "llama_arg_ctx_size": "ctx-size",
}


@dataclass(frozen=True)
class SimModel:
    """One model the router serves: its figures on the router's Mac, and its child's flags."""

    name: str
    machine: Machine
    parallel: int | None = None  # the child's --parallel (None: the machine's default_parallel)
    ctx_size: int | None = None  # the child's --ctx-size, total over its slots (None or 0: the machine's)
    model: str | None = None  # the child's --model, reported as its model_path (None: the name)


def on_mac(model: Machine, mac: Machine) -> Machine:
    """``model``'s figures (weights, KV, speed) on ``mac``'s memory."""
    return model.model_copy(update={name: getattr(mac, name) for name in MAC_FIELDS})


def router_models(settings: SimSettings, mac: Machine) -> list[SimModel]:
    """The models of ``--models`` or of ``--models-preset`` (exactly one of them), on ``mac``."""
    if settings.models and settings.models_preset is not None:
        raise MachineError("give --models or --models-preset, not both")
    if settings.models_preset is not None:
        return preset_file_models(settings.models_preset, settings, mac)
    if not settings.models:
        raise MachineError("router mode needs --models NAME=PRESET[,...] or --models-preset FILE.ini")
    return [SimModel(name, on_mac(load_preset(preset), mac), settings.parallel, settings.ctx_size)
            for name, preset in parse_models(settings.models).items()]


def parse_models(spec: str) -> dict[str, str]:
    """``NAME=PRESET[,NAME=PRESET...]`` -> {name: preset}."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, preset = part.partition("=")
        if not sep or not name or not preset:
            raise MachineError(f"--models takes NAME=PRESET[,NAME=PRESET...], not {part!r}")
        if name in out:
            raise MachineError(f"--models names {name!r} twice")
        out[name] = preset
    if not out:
        raise MachineError("--models names no model")
    return out


def read_models_preset(path: Path) -> dict[str, dict[str, str]]:
    """A llama-server model-preset INI file -> {model id: {argument: value}}: each model's section over the
    ``[*]`` section, the arguments the simulator reads under their long names (``np`` -> ``parallel``),
    every other key as written. Top-level keys (``version = 1``) belong to no model."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise MachineError(f"cannot read --models-preset {str(path)!r}: {exc.strerror}") from exc
    parser = configparser.ConfigParser(interpolation=None, strict=False, default_section=NO_DEFAULTS,
                                       comment_prefixes=(";", "#"), inline_comment_prefixes=(";", "#"))
    try:
        parser.read_string(f"[{TOP_LEVEL}]\n{text}", source=str(path))
    except configparser.ParsingError as exc:
        lineno, line = exc.errors[0]
        raise MachineError(f"{path}: line {lineno - 1} is not a [section], a key = value or a comment: "
                           f"{line}") from exc
    except configparser.Error as exc:
        raise MachineError(f"{path}: {exc.message}") from exc
    shared = _arguments(parser[GLOBAL_SECTION]) if parser.has_section(GLOBAL_SECTION) else {}
    models = {name: {**shared, **_arguments(parser[name])}
              for name in parser.sections() if name not in (TOP_LEVEL, GLOBAL_SECTION)}
    if not models:
        raise MachineError(f"{path}: no model section ([model-id] with model = ...)")
    return models


def _arguments(section: Mapping[str, str]) -> dict[str, str]:
    return {ARGUMENTS.get(key.lstrip("-"), key.lstrip("-")): value for key, value in section.items()}


def preset_file_models(path: Path, settings: SimSettings, mac: Machine) -> list[SimModel]:
    """The models of a model-preset INI file on ``mac``: a section's ``parallel``/``ctx-size`` for its child,
    else the router's ``--parallel``/``--ctx-size``."""
    specs: list[SimModel] = []
    for name, args in read_models_preset(path).items():
        where = f"{path} [{name}]"
        model = args.get("model")
        if not model:
            raise MachineError(f"{where}: no model (model = FILE.gguf, a machine FILE.json or a preset name)")
        parallel = _integer(args, "parallel", where, minimum=1)
        ctx_size = _integer(args, "ctx-size", where, minimum=0)
        specs.append(SimModel(
            name, on_mac(model_machine(model, mac, where), mac),
            parallel=settings.parallel if parallel is None else parallel,
            ctx_size=settings.ctx_size if ctx_size is None else ctx_size,
            model=model,
        ))
    return specs


def _integer(args: Mapping[str, str], key: str, where: str, minimum: int) -> int | None:
    if key not in args:
        return None
    try:
        value = int(args[key])
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise MachineError(f"{where}: {key} = {args[key]!r}: not an integer >= {minimum}")
    return value


def model_machine(model: str, mac: Machine, where: str) -> Machine:
    """A preset section's ``model``: a GGUF file (on ``mac``'s figures), a machine JSON file or a preset."""
    path = Path(model).expanduser()
    suffix = path.suffix.lower()
    try:
        if suffix == ".gguf":
            return gguf_machine(path, mac)
        if suffix == ".json":
            return load_machine(path)
        return load_preset(model)
    except MachineError as exc:
        raise MachineError(f"{where}: {exc}") from exc


def gguf_machine(path: Path, mac: Machine) -> Machine:
    """``mac`` serving the GGUF model at ``path``: the file's size as weights, and its f16 KV cache per token
    allocated for every slot at start, as llama-server does; speed and buffers stay ``mac``'s."""
    if not path.is_file():
        raise MachineError(f"no model file {str(path)!r}")
    try:
        shape = read_shape(path)
    except GGUFError as exc:
        raise MachineError(str(exc)) from exc
    return mac.with_changes(weights_gb=shape.file_bytes / 2**30, kv_at_start=True, model_name=path.name,
                            kv_mb_per_token=shape.kv_bytes_per_token() / 2**20)
