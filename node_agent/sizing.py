"""How many slots a supervised llama-server gets when the operator does not say: what fits the Mac.

llama-server allocates every slot's KV cache for its whole context when it starts, so the slot count is a
start-up memory question: ``(wired limit - weights - headroom) / (KV bytes per token x context per slot)``,
from the GGUF's attention shape, bounded by the calibrated cap (more slots than the Mac serves well only
hold memory) and by ``MAX_SLOTS``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .memory import GB

DEFAULT_SLOTS = 4  # when memory cannot be sized (no GGUF shape, no wired limit)
MAX_SLOTS = 32
SHRINK = 0.75  # after persistent memory pressure, restart with a quarter fewer slots


@dataclass(frozen=True)
class Sizing:
    """The slot count llama-server runs with, and why."""

    parallel: int
    ctx_per_slot: int
    chosen_by: str  # "operator" (--parallel), "memory", "calibrated", "default" or "pressure"
    reason: str
    fits: int | None = None  # slots the memory budget holds
    budget_gb: float | None = None
    per_slot_gb: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def choose(
    *,
    parallel: int | None,
    ctx_per_slot: int,
    wired_limit_gb: float | None,
    weights_gb: float | None,
    headroom_gb: float,
    kv_bytes_per_token: int | None,
    calibrated_cap: int | None,
) -> Sizing:
    """The operator's ``--parallel`` when given, else the slots that fit, bounded by the calibrated cap."""
    if parallel is not None:
        said = f"{parallel} slots x {ctx_per_slot} tokens (--parallel)"
        return Sizing(parallel, ctx_per_slot, "operator", said)
    if wired_limit_gb is None or not kv_bytes_per_token:
        missing = "no wired limit" if wired_limit_gb is None else "no KV shape in the model file"
        slots = min(DEFAULT_SLOTS, calibrated_cap or DEFAULT_SLOTS)
        return Sizing(max(1, slots), ctx_per_slot, "default",
                      f"{max(1, slots)} slots x {ctx_per_slot} tokens: {missing} to size memory by")
    per_slot = kv_bytes_per_token * ctx_per_slot / GB
    budget = wired_limit_gb - (weights_gb or 0.0) - headroom_gb
    fits = max(0, math.floor(budget / per_slot + 1e-9))
    slots, chosen_by = min(fits, MAX_SLOTS), "memory"
    said = f"{fits} fit (wired limit {wired_limit_gb:.1f} GB - weights {weights_gb or 0.0:.1f} GB - " \
           f"headroom {headroom_gb:.1f} GB, {per_slot:.2f} GB a slot)"
    if calibrated_cap is not None and calibrated_cap < slots:
        slots, chosen_by = calibrated_cap, "calibrated"
        said += f", calibrated cap {calibrated_cap}"
    elif fits > MAX_SLOTS:
        said += f", at most {MAX_SLOTS}"
    if slots < 1:
        slots = 1
        said += "; not even one slot fits: starting 1, expect paging (lower --ctx-per-slot or --headroom-gb)"
    return Sizing(slots, ctx_per_slot, chosen_by, f"{slots} slots x {ctx_per_slot} tokens: {said}", fits,
                  round(budget, 3), round(per_slot, 4))


def shrunk(sizing: Sizing, beats: int) -> Sizing | None:
    """A quarter fewer slots after ``beats`` heartbeats of memory pressure; None when already at one."""
    slots = min(sizing.parallel - 1, math.floor(sizing.parallel * SHRINK))
    if slots < 1:
        return None
    reason = (f"{slots} slots x {sizing.ctx_per_slot} tokens: memory pressure for {beats} heartbeats "
              f"with {sizing.parallel}")
    return Sizing(slots, sizing.ctx_per_slot, "pressure", reason, sizing.fits, sizing.budget_gb,
                  sizing.per_slot_gb)
