"""Light requests (token counts, templates; macpool/apis.py): no slot and no queue, but a cap of their own.

Each router lets at most ``--light-concurrency`` light requests be in flight on one node at a time, and
sends each to the candidate node where it has the fewest; the agent's own cap is the safety net across
routers (docs/router.md, "Light endpoints"). Counted in this process only: a light request is answered in
milliseconds, and a count in Redis would cost more than the request.
"""

from __future__ import annotations

from collections.abc import Sequence

from macpool.contract import NodeDoc


class LightHold:
    """A light request's place on its node, held until its answer ends (router/forward.py ``Hold``)."""

    def __init__(self, limits: LightLimits, node: NodeDoc) -> None:
        self.limits = limits
        self.node = node
        self.held = True

    async def give_back(self, failed: bool = False) -> None:
        if not self.held:
            return
        self.held = False
        node_id = self.node.node_id
        left = self.limits.in_flight[node_id] - 1
        if left:
            self.limits.in_flight[node_id] = left
        else:
            del self.limits.in_flight[node_id]


class LightLimits:
    def __init__(self, per_node: int) -> None:
        self.per_node = per_node
        self.in_flight: dict[str, int] = {}  # node id -> light requests this router has in flight there

    def take(self, candidates: Sequence[NodeDoc]) -> LightHold | None:
        """A place on the candidate with the fewest light requests in flight, if any is under the cap."""
        if not candidates:
            return None
        node = min(candidates, key=lambda doc: self.in_flight.get(doc.node_id, 0))
        held = self.in_flight.get(node.node_id, 0)
        if held >= self.per_node:
            return None
        self.in_flight[node.node_id] = held + 1
        return LightHold(self, node)
