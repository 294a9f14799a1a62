"""The simulator's one settings object, built at the CLI edge (flags, MACPOOL_SIM_* env) and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from macpool.sim import __version__
from macpool.sim.engine import ServerOptions
from macpool.sim.machine import Machine, MachineError, load_machine, load_preset

DEFAULT_PRESET = "m5max-128g-14b-q4"
AUTO_PARALLEL = 4  # llama-server's slots for --parallel -1 (auto), over a unified KV cache


class SimSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MACPOOL_SIM_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    preset: str | None = None
    machine: Path | None = Field(None, description="--machine: a machine description JSON file")
    parallel: int | None = Field(
        None, description="slots (-np); default: the machine's; negative: llama-server's auto"
    )
    ctx_size: int | None = Field(None, ge=0, description="total context (-c), split across slots")
    kv_unified: bool | None = Field(
        None, description="-kvu/-no-kvu: the slots share one pool of cells (default: only with -np auto)"
    )
    kv_unified_per_slot: int | None = Field(
        None, gt=0, description="--kv-unified-per-slot: the most context one slot may take; without -c, "
        "the context is this x the slots"
    )
    cache_ram: int = Field(
        8192, ge=-1, description="--cache-ram: MiB of prompt cache in host memory (-1: no limit, 0: none)"
    )
    cache_idle_slots: bool = Field(True, description="save idle slots to the prompt cache as a task starts")
    slot_prompt_similarity: float = Field(
        0.1, ge=0, le=1, description="how much of a prompt a slot must hold to be chosen for it (0: never)"
    )
    model: str | None = Field(None, description="-m: the model's path or name, reported like llama-server")
    alias: str | None = None
    metrics: bool = False
    # simulated: every time figure of /metrics in simulated seconds, as the rest of the simulator reports;
    # wall: its prompt and generation seconds (and their rates) in wall seconds, as agents and routers in
    # front of a simulator run faster than real time measure everything else of it (first tokens, decode)
    metrics_clock: Literal["simulated", "wall"] = "simulated"
    speed: float = Field(1.0, gt=0)
    load_seconds: float = Field(0.0, ge=0)
    # router mode (macpool/sim/router_mode.py): several models served on this Mac, loaded on demand
    models: str | None = Field(None, description="--models: router mode, NAME=PRESET[,NAME=PRESET...]")
    models_preset: Path | None = Field(
        None, description="--models-preset: router mode, the models of a llama-server model-preset INI file"
    )
    models_max: int = Field(4, ge=0, description="--models-max: most models loaded at once (0: no limit)")
    models_autoload: bool = Field(True, description="load an unloaded model a request names")

    @field_validator("parallel")
    @classmethod
    def _some_slots(cls, value: int | None) -> int | None:
        if value == 0:  # as llama-server: negative means auto, zero is an error
            raise ValueError("must not be 0 (-1: auto)")
        return value

    def load_machine(self) -> Machine:
        if self.machine is not None:
            if self.preset is not None:
                raise MachineError("give --preset or --machine, not both")
            return load_machine(self.machine)
        return load_preset(self.preset or DEFAULT_PRESET)


def build_info() -> str:
    return f"sim-{__version__}"


class Resolved:
    """What the settings mean for one machine, as llama-server reads its flags: the slots, the KV cache behind
    them (cells, one pool or one stream per slot), the context of one slot, the caches, the model names."""

    def __init__(self, settings: SimSettings, machine: Machine) -> None:
        if settings.parallel is None:  # the Mac's llama-server as its preset describes it
            self.n_slots = machine.default_parallel
            unified = machine.kv_unified if settings.kv_unified is None else settings.kv_unified
        elif settings.parallel < 0:  # llama-server's auto: 4 slots, unified whatever -kvu says
            self.n_slots, unified = AUTO_PARALLEL, True
        else:
            self.n_slots, unified = settings.parallel, bool(settings.kv_unified)
        cap = settings.kv_unified_per_slot
        total = settings.ctx_size or self.n_slots * (cap or machine.ctx_per_slot)
        per_sequence = total if unified else max(1, total // self.n_slots)
        self.kv_unified = unified
        self.n_cells = total if unified else per_sequence * self.n_slots
        # llama-server's n_ctx_slot: a sequence's context, capped by --kv-unified-per-slot and the model's
        # training context
        self.n_ctx_slot = min(per_sequence, cap or per_sequence, machine.n_ctx_train)
        self.options = ServerOptions(
            kv_unified=unified, n_cells=self.n_cells, cache_ram_mib=settings.cache_ram,
            cache_idle_slots=settings.cache_idle_slots,
            slot_prompt_similarity=settings.slot_prompt_similarity,
        )
        self.model_path = settings.model or machine.model_name
        self.model_name = settings.alias or Path(self.model_path).name
