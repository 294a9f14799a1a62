"""What the autoscaler decides from one look at the pool, with hysteresis, bounds and a cool-down.

Up: when demand exceeds the target share of the capacity that serves or is coming (ready, loading,
waking) for ``up_delay``, activate standby nodes - and wake sleeping Macs - until it fits. A pool with
no capacity at all and demand waiting (scale from zero), or below ``min_nodes``, acts at once. Down: when
demand would fit under the low share of the ready capacity less one node for ``down_delay``, send that
node (the least busy elastic one) to standby. After any action the pool is left ``cooldown_s`` before the
next scale-down; scale-up needs no cool-down, since nodes on their way count as capacity already.
Every call takes ``now`` (seconds, monotonic), so tests pass the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from macpool.contract import NodeDoc
from macpool.scaling import ScalePolicy
from macpool.store.elastic import WakeTarget

ActionKind = Literal["activate", "wake", "standby"]


@dataclass(frozen=True)
class PoolView:
    """The pool as the policy sees it: demand in slots, capacity by phase, and who can be moved."""

    demand: float
    ready_capacity: int
    pending_capacity: int  # loading nodes, and Macs woken that have not come back yet
    active: int  # nodes serving or on their way (every node but standby ones)
    standby: list[NodeDoc] = field(default_factory=list)  # elastic nodes in standby, biggest first
    shrinkable: list[NodeDoc] = field(default_factory=list)  # elastic ready nodes, least busy first
    asleep: list[WakeTarget] = field(default_factory=list)  # known Macs, no heartbeat, a MAC to wake


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    node_id: str
    reason: str
    target: WakeTarget | None = None  # for "wake"


@dataclass
class Policy:
    config: ScalePolicy
    cooldown_s: float = 30.0  # no scale-down this long after any action
    up_since: float | None = None
    down_since: float | None = None
    quiet_until: float = -math.inf  # no scale-down before then (the cool-down)

    def step(self, view: PoolView, now: float) -> list[Action]:
        cfg = self.config
        supply = view.ready_capacity + view.pending_capacity
        short = view.active < cfg.min_nodes
        cold = supply == 0 and view.demand > 0
        if short or cold or view.demand > supply * cfg.target_utilisation:
            self.down_since = None
            self.up_since = now if self.up_since is None else self.up_since
            if not (short or cold) and now - self.up_since < cfg.up_delay:
                return []
            actions = self._grow(view)
            if actions:
                self.up_since = None
                self.quiet_until = now + self.cooldown_s
            return actions
        self.up_since = None
        return self._shrink(view, now)

    def _grow(self, view: PoolView) -> list[Action]:
        cfg = self.config
        wanted = view.demand / cfg.target_utilisation - view.ready_capacity - view.pending_capacity
        room = cfg.max_nodes - view.active
        why = (f"demand {view.demand:.1f} slots over {view.ready_capacity} ready + {view.pending_capacity} "
               f"coming at {cfg.target_utilisation:.0%} target")
        if view.active < cfg.min_nodes:
            why = f"{view.active} node(s) active, below --min-nodes {cfg.min_nodes}"
        actions: list[Action] = []
        for doc in view.standby:
            if room <= 0 or (wanted <= 0 and view.active + len(actions) >= cfg.min_nodes):
                return actions
            actions.append(Action("activate", doc.node_id, why))
            wanted -= doc.standby_capacity or 1
            room -= 1
        for target in view.asleep:
            if room <= 0 or (wanted <= 0 and view.active + len(actions) >= cfg.min_nodes):
                return actions
            actions.append(Action("wake", target.node_id, why, target))
            wanted -= target.standby_capacity or 1
            room -= 1
        return actions

    def _shrink(self, view: PoolView, now: float) -> list[Action]:
        cfg = self.config
        if now < self.quiet_until or view.pending_capacity or view.active <= cfg.min_nodes:
            self.down_since = None
            return []
        if not view.shrinkable:
            self.down_since = None
            return []
        node = view.shrinkable[0]
        after = view.ready_capacity - node.capacity
        if view.demand > after * cfg.low_utilisation:
            self.down_since = None
            return []
        self.down_since = now if self.down_since is None else self.down_since
        if now - self.down_since < cfg.down_delay:
            return []
        self.down_since = None
        self.quiet_until = now + self.cooldown_s
        why = (f"demand {view.demand:.1f} slots fits under {cfg.low_utilisation:.0%} of the {after} ready "
               f"without it for {cfg.down_delay:.0f}s")
        return [Action("standby", node.node_id, why)]
