"""The simulator's one settings object, built at the CLI edge (flags, MACPOOL_SIM_* env) and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from simulator import __version__
from simulator.machine import Machine, MachineError, load_machine, load_preset

DEFAULT_PRESET = "m5max-128g-14b-q4"


class SimSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MACPOOL_SIM_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    preset: str | None = None
    machine: Path | None = Field(None, description="--machine: a machine description JSON file")
    parallel: int | None = Field(None, gt=0, description="slots (-np); default: the machine's")
    ctx_size: int | None = Field(None, ge=0, description="total context (-c), split across slots")
    model: str | None = Field(None, description="-m: the model's path or name, reported like llama-server")
    alias: str | None = None
    metrics: bool = False
    speed: float = Field(1.0, gt=0)
    load_seconds: float = Field(0.0, ge=0)
    # router mode (simulator/router_mode.py): several models served on this Mac, loaded on demand
    models: str | None = Field(None, description="--models: router mode, NAME=PRESET[,NAME=PRESET...]")
    models_preset: Path | None = Field(
        None, description="--models-preset: router mode, the models of a llama-server model-preset INI file"
    )
    models_max: int = Field(4, ge=0, description="--models-max: most models loaded at once (0: no limit)")
    models_autoload: bool = Field(True, description="load an unloaded model a request names")

    def load_machine(self) -> Machine:
        if self.machine is not None:
            if self.preset is not None:
                raise MachineError("give --preset or --machine, not both")
            return load_machine(self.machine)
        return load_preset(self.preset or DEFAULT_PRESET)


def build_info() -> str:
    return f"sim-{__version__}"


class Resolved:
    """What the settings mean for one machine: slot count, per-slot context, model names."""

    def __init__(self, settings: SimSettings, machine: Machine) -> None:
        self.n_slots = settings.parallel or machine.default_parallel
        total = settings.ctx_size or machine.ctx_per_slot * self.n_slots
        self.n_ctx_slot = max(1, total // self.n_slots)
        self.model_path = settings.model or machine.model_name
        self.model_name = settings.alias or Path(self.model_path).name
