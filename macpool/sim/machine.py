"""The machine description: a Mac's unified memory and decode/prefill speed, as a small physical model.

Every figure the simulator reports is derived from these parameters (see docs/simulator.md):

- pinned memory = weights + base + external + sum over in-flight sequences of
  ``seq_overhead_gb + kv_mb_per_token/1024 * tokens_in_kv`` (the seed's working set, growing per request);
  or, with ``kv_at_start`` (llama-server's real allocation), weights + base + external +
  ``slots * ctx_per_slot * kv_mb_per_token/1024``, allocated at start and flat under load;
- a step (one llama_decode call) costs ``t0 + t1 * decode_batch + prefill_tokens / prefill_tok_s`` seconds,
  multiplied by the paging penalty ``1 + (overflow_gb / paging_scale_gb) ** paging_exponent`` once pinned
  memory passes the wired limit; attention makes both terms grow with the context each token sees: a decoded
  token adds ``decode_ms_per_1k_ctx`` per 1,000 tokens its sequence holds, and a prompt token at position
  ``p`` costs ``1 + p / prefill_halving_depth`` times one at position 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PRESET_PACKAGE = "macpool.sim.presets"


class MachineError(ValueError):
    """A machine description that cannot be loaded."""


class StartFailure(MachineError):
    """llama-server could not allocate its buffers at start (``overcommit: fail``): it exits with status 1."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(lines[0])
        self.lines = lines


class MemoryState(StrEnum):
    HEALTHY = "healthy"
    NEAR_CEILING = "near_ceiling"
    PAGING = "paging"
    COLLAPSED = "collapsed"


# how bad each state is, for "worst state seen" summaries
STATE_ORDER = {s.value: i for i, s in enumerate(MemoryState)}


class Machine(BaseModel):
    """One Mac + one model, as the simulator sees it. All sizes in GB (2**30 bytes), times in seconds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    model_name: str = Field(description="model file name reported by /props and /v1/models")
    total_gb: float = Field(gt=0, description="unified memory size")
    wired_limit_gb: float = Field(gt=0, description="most memory the GPU may pin before the system pages")
    weights_gb: float = Field(ge=0)
    base_gb: float = Field(ge=0, description="compute buffers and runtime that do not grow with load")
    seq_overhead_gb: float = Field(ge=0, description="fixed working set of one in-flight sequence")
    kv_mb_per_token: float = Field(ge=0, description="working set growth per token held (prompt + generated)")
    decode_t0_ms: float = Field(gt=0, description="fixed cost of one decode step (streaming the weights)")
    decode_t1_ms: float = Field(ge=0, description="added cost per sequence in the decode batch")
    prefill_tok_s: float = Field(gt=0, description="marginal prompt-processing rate inside a step")
    prefill_halving_depth: float = Field(
        0.0, ge=0, description="position where a prompt token costs twice what it costs at 0 (0: no growth)"
    )
    decode_ms_per_1k_ctx: float = Field(
        0.0, ge=0, description="added decode cost of a sequence per 1,000 tokens it holds"
    )
    n_batch: int = Field(2048, gt=0, description="most tokens one step processes (llama-server -b)")
    near_ceiling_fraction: float = Field(0.8, gt=0, le=1)
    paging_scale_gb: float = Field(gt=0)
    paging_exponent: float = Field(gt=0)
    collapse_overflow_gb: float = Field(gt=0, description="overflow past the wired limit that means collapse")
    ctx_per_slot: int = Field(8192, gt=0, description="default context per slot (-c: this x the slots)")
    default_parallel: int = Field(4, gt=0)
    kv_unified: bool = Field(
        False, description="without -np: the slots share one pool of cells (llama-server's --parallel auto)"
    )
    n_ctx_train: int = Field(131072, gt=0, description="the model's training context: caps a slot's context")
    state_copy_gb_s: float = Field(
        0.0, ge=0, description="how fast a slot's KV state is saved to or restored from the prompt cache "
        "(0: the copies take no time)"
    )
    typical_prompt_tokens: int = Field(4096, gt=0, description="prompt size per_request_gb is quoted at")
    typical_output_tokens: int = Field(256, ge=0)
    default_n_predict: int = Field(256, gt=0, description="tokens generated when a request sets no limit")
    kv_at_start: bool = Field(
        False, description="allocate every slot's whole KV cache at start, flat under load (llama-server)"
    )
    load_gb_s: float = Field(5.0, gt=0, description="how fast a model's weights load from disk (router mode)")
    overcommit: Literal["page", "fail"] = Field(
        "page", description="a start past the wired limit: page from the first request, or fail to load"
    )

    # --- memory -------------------------------------------------------------------------------------------
    def sequence_gb(self, tokens: int) -> float:
        return self.seq_overhead_gb + self.kv_mb_per_token * tokens / 1024.0

    def per_request_gb(self) -> float:
        """The working set one more typical request adds (what an agent divides its headroom by)."""
        return self.sequence_gb(self.typical_prompt_tokens + self.typical_output_tokens)

    def fixed_gb(self, external_gb: float = 0.0) -> float:
        return self.weights_gb + self.base_gb + external_gb

    def kv_cache_gb(self, n_cells: int) -> float:
        """The KV cache llama-server allocates at start for ``n_cells`` cells (its whole context; 0 in the
        growing working-set model)."""
        return n_cells * self.kv_mb_per_token / 1024.0 if self.kv_at_start else 0.0

    def start_gb(self, n_cells: int) -> float:
        return self.fixed_gb() + self.kv_cache_gb(n_cells)

    def check_start(self, n_cells: int, model_path: str) -> None:
        """Raise :class:`StartFailure` with llama-server's log lines when ``overcommit: fail`` and the start
        does not fit under the wired limit."""
        need = self.start_gb(n_cells)
        if self.overcommit != "fail" or need <= self.wired_limit_gb:
            return
        kv_mib = self.kv_cache_gb(n_cells) * 1024
        raise StartFailure([
            f"ggml_metal_buffer_init: error: failed to allocate buffer, size = {kv_mib:.2f} MiB "
            f"({need:.1f} GB needed at start, wired limit {self.wired_limit_gb:.1f} GB)",
            "llama_init_from_model: failed to initialize the context: failed to allocate buffer for kv cache",
            f"common_init_from_params: failed to create context with model '{model_path}'",
            f"srv    load_model: failed to load model, '{model_path}'",
            "main: exiting due to model loading error",
        ])

    def state(self, pinned_gb: float) -> MemoryState:
        overflow = pinned_gb - self.wired_limit_gb
        if overflow >= self.collapse_overflow_gb:
            return MemoryState.COLLAPSED
        if overflow > 0:
            return MemoryState.PAGING
        if pinned_gb >= self.near_ceiling_fraction * self.wired_limit_gb:
            return MemoryState.NEAR_CEILING
        return MemoryState.HEALTHY

    def paging_penalty(self, pinned_gb: float) -> float:
        overflow = pinned_gb - self.wired_limit_gb
        if overflow <= 0:
            return 1.0
        return 1.0 + float((overflow / self.paging_scale_gb) ** self.paging_exponent)

    # --- time ---------------------------------------------------------------------------------------------
    def step_seconds(
        self, decode_held: Sequence[int], prefill: Sequence[tuple[int, int]], pinned_gb: float
    ) -> float:
        """One llama_decode: a token for each sequence in ``decode_held`` (the tokens each holds), and each
        ``(start, n)`` prompt chunk: ``n`` tokens from position ``start``."""
        decode_ms = self.decode_t0_ms + self.decode_t1_ms * len(decode_held)
        if self.decode_ms_per_1k_ctx:
            decode_ms += self.decode_ms_per_1k_ctx * sum(decode_held) / 1000.0
        compute = decode_ms / 1000.0 + self.prefill_work(prefill) / self.prefill_tok_s
        return compute * self.paging_penalty(pinned_gb)

    def prefill_work(self, prefill: Sequence[tuple[int, int]]) -> float:
        """Prompt chunks in tokens at position 0: attention makes a token at position p cost
        ``1 + p / prefill_halving_depth`` of those (summed over a chunk: its middle position)."""
        if not self.prefill_halving_depth:
            return float(sum(n for _, n in prefill))
        depth = self.prefill_halving_depth
        return sum(n * (1.0 + (start + (n - 1) / 2.0) / depth) for start, n in prefill)

    def state_copy_seconds(self, n_tokens: int) -> float:
        """Saving a slot's KV state of ``n_tokens`` to the prompt cache in host memory, or restoring it."""
        if not self.state_copy_gb_s:
            return 0.0
        return n_tokens * self.kv_mb_per_token / 1024.0 / self.state_copy_gb_s

    def with_changes(self, **changes: object) -> Machine:
        return self.model_validate({**self.model_dump(), **changes})


def preset_names() -> list[str]:
    folder = resources.files(PRESET_PACKAGE)
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_preset(name: str) -> Machine:
    path = resources.files(PRESET_PACKAGE) / f"{name}.json"
    if not path.is_file():
        raise MachineError(f"unknown preset {name!r} (known: {', '.join(preset_names())})")
    return _parse(path.read_text(), f"preset {name!r}")


def load_machine(path: Path) -> Machine:
    try:
        text = path.read_text()
    except OSError as exc:
        raise MachineError(f"cannot read machine file {str(path)!r}: {exc.strerror}") from exc
    return _parse(text, f"machine file {str(path)!r}")


def _parse(text: str, what: str) -> Machine:
    try:
        data = json.loads(text)
        return Machine.model_validate(data)
    except json.JSONDecodeError as exc:
        raise MachineError(f"{what} is not valid JSON: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise MachineError(f"{what}: {where}: {first['msg']}") from exc
