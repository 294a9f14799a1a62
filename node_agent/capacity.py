"""Honest capacity: ``min(configured, memory-derived, calibrated)``, and no new work under memory pressure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from macpool.contract import CapacityBreakdown, MemoryState

from .memory import MemorySample

NEAR_LIMIT = 0.97  # pinned at this fraction of the wired limit counts as pressure
SWAP_GROWTH_GB = 0.05  # swap growing by more than this between two heartbeats counts as pressure


def memory_cap(wired_limit_gb: float, weights_gb: float, headroom_gb: float, per_request_gb: float) -> int:
    """floor((wired limit - weights - headroom) / per-request working set), never below 0."""
    if per_request_gb <= 0:
        raise ValueError("per_request_gb must be positive")
    return max(0, math.floor((wired_limit_gb - weights_gb - headroom_gb) / per_request_gb + 1e-9))


def memory_state(sample: MemorySample) -> MemoryState:
    if sample.state is not None:
        return sample.state
    if sample.pinned_gb >= sample.wired_limit_gb or sample.pressure == "critical":
        return "paging"
    if sample.pinned_gb >= 0.9 * sample.wired_limit_gb or sample.pressure == "warning":
        return "near_ceiling"
    return "healthy"


@dataclass
class PressureGuard:
    """Admit nothing new while memory is under pressure; let go only after ``recover_beats`` calm samples."""

    recover_beats: int = 3
    limited: bool = False
    reason: str = ""
    pressed: bool = False  # the last sample itself showed pressure (``limited`` also covers the calm beats)
    _calm: int = 0
    _last_swap_gb: float | None = None

    def update(self, sample: MemorySample) -> bool:
        why = self._pressure(sample)
        self.pressed = bool(why)
        self._last_swap_gb = sample.swap_used_gb
        if why:
            self.limited, self.reason, self._calm = True, why, 0
        elif self.limited:
            self._calm += 1
            if self._calm >= self.recover_beats:
                self.limited, self.reason = False, ""
        return self.limited

    def _pressure(self, sample: MemorySample) -> str:
        if sample.pressure != "normal":
            return f"memory pressure {sample.pressure}"
        if sample.state in ("paging", "collapsed"):
            return f"memory {sample.state}"
        if sample.wired_limit_gb > 0 and sample.pinned_gb >= NEAR_LIMIT * sample.wired_limit_gb:
            return f"pinned {sample.pinned_gb:.1f} GB near the wired limit {sample.wired_limit_gb:.1f} GB"
        if self._last_swap_gb is not None and sample.swap_used_gb - self._last_swap_gb > SWAP_GROWTH_GB:
            return f"swap growing ({sample.swap_used_gb:.2f} GB used)"
        return ""


@dataclass(frozen=True)
class Decision:
    capacity: int
    breakdown: CapacityBreakdown
    reason: str


def decide(
    configured: int | None,
    memory: int | None,
    calibrated: int | None,
    in_flight: int,
    pressure_reason: str = "",
    slots: int | None = None,
) -> Decision:
    """The capacity to enforce and advertise, with each term and why the smallest one wins.

    ``configured`` is ``--cap``, ``slots`` llama-server's ``total_slots`` (None: not known). The configured
    term is the smaller of the two: a request past the slots would wait in llama-server's own queue, where
    no router can see it or send it to a node with room.
    """
    parallel = min((value for value in (configured, slots) if value is not None), default=None)
    terms = {"configured": parallel, "memory": memory, "calibrated": calibrated}
    known = {name: value for name, value in terms.items() if value is not None}
    capacity = min(known.values()) if known else 0
    reason = ""
    if known:
        limiting = min(known, key=lambda name: known[name])
        reason = f"capacity {capacity} set by the {limiting} limit"
        if limiting == "configured" and parallel == slots and configured != slots:
            reason = f"capacity {capacity} set by llama-server's {slots} slots"
            if configured is not None:
                reason += f" (--cap {configured} is above them)"
    if pressure_reason:
        capacity = min(capacity, in_flight)
        reason = f"{pressure_reason}: admitting nothing new (capacity {capacity} = in flight)"
    breakdown = CapacityBreakdown(
        configured=parallel, memory=memory, calibrated=calibrated, pressure_limited=bool(pressure_reason)
    )
    return Decision(capacity=capacity, breakdown=breakdown, reason=reason)
