"""How many Macs the pool's demand needs: the knobs of the scaling policy, declared once.

The router's scale hint (router/scale.py) and `macpool autoscale` (macpool/autoscale/policy.py) apply the same
policy: up when demand passes the target share of the capacity for ``up_delay`` seconds, down when it would
fit under the low share of less capacity for ``down_delay``, between ``min_nodes`` and ``max_nodes``. Their
settings models inherit these fields, each under its own names: the autoscaler's are these
(``--target-utilisation``), the router's have a ``scale_`` prefix (``--scale-target-utilisation``).
"""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import BaseModel, Field, model_validator

# the one knob whose default differs: the hint asks for one Mac at least, the autoscaler may keep none on
MinNodes = Annotated[
    int, Field(ge=0, description="the fewest Macs to keep (0: none while nothing is asked of the pool)")
]


class ScalePolicy(BaseModel):
    """The scaling policy's knobs."""

    target_utilisation: float = Field(
        default=0.8, gt=0, le=1,
        description="scale up when demand (busy + queued + turned away) passes this share of the capacity",
    )
    low_utilisation: float = Field(
        default=0.5, gt=0, le=1,
        description="scale down when demand would fit under this share of the capacity without a Mac (at "
        "most the target)",
    )
    up_delay: float = Field(
        default=10.0, ge=0, description="seconds demand must stay over the target before scaling up"
    )
    down_delay: float = Field(
        default=120.0, ge=0, description="seconds demand must stay under the low share before scaling down"
    )
    min_nodes: MinNodes = 0
    max_nodes: int = Field(default=64, ge=1, description="the most Macs to have on (at least the fewest)")

    @model_validator(mode="after")
    def _bands(self) -> Self:
        if self.low_utilisation > self.target_utilisation:
            raise ValueError(f"{self.key('low_utilisation')} ({self.low_utilisation}) is over "
                             f"{self.key('target_utilisation')} ({self.target_utilisation})")
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"{self.key('min_nodes')} ({self.min_nodes}) is over {self.key('max_nodes')} "
                             f"({self.max_nodes})")
        return self

    @classmethod
    def key(cls, knob: str) -> str:
        """The name a settings model gives ``knob`` (its key, its flag in kebab-case)."""
        alias = cls.model_fields[knob].validation_alias
        return alias if isinstance(alias, str) else knob

    def policy(self) -> ScalePolicy:
        """The knobs alone, out of a settings model that holds them."""
        return ScalePolicy(**{knob: getattr(self, knob) for knob in ScalePolicy.model_fields})


def number(mapping: dict[str, Any], key: str) -> float:
    """``mapping[key]`` as a float; 0 when it is missing or not a number."""
    value = mapping.get(key)
    return float(value) if isinstance(value, int | float) else 0.0


def demand_of(pool: dict[str, Any]) -> tuple[float, float]:
    """(demand in concurrent requests, the part of it that was turned away)."""
    busy = number(pool, "busy")
    # in slots: a queued request for several generations holds several
    queued = max(number(pool, "queued_slots"), number(pool, "queued"))
    rejections = number(pool, "rejections_per_s")
    requests = number(pool, "requests_per_s")
    # Little's law: a turned-away request would have held a slot for busy / admitted-rate seconds
    # (the router's requests_per_s counts every arrival, the rejected ones too).
    admitted = requests - rejections
    hold_s = busy / admitted if admitted > 0 and busy > 0 else 1.0
    # A client retrying sooner than that is counted once per retry (the router cannot tell a retry from a
    # new request), so a few impatient clients could ask for dozens of Macs: the turned-away part counts at
    # most the pool's current capacity - desired nodes at most double per step, and keep growing while the
    # pool stays full.
    rejected = min(rejections * hold_s, max(number(pool, "capacity"), 1.0))
    return busy + queued + rejected, rejected
