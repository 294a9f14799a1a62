"""Shared pieces of the operator tests: the running pool's handle and a poll-until-true helper."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from tests.conftest import Server as Server
from tests.conftest import wait_until as wait_until

ADMIN_KEY = "operator-test-admin"
AGENT_TOKEN = "operator-test-token"
HEARTBEAT_S = 1.0  # the node key lives about three of these



@dataclass
class Pool:
    router: Server
    agents: dict[str, Server] = field(default_factory=dict)
    sims: dict[str, Server] = field(default_factory=dict)

    def view(self) -> dict[str, object]:
        data: dict[str, object] = httpx.get(f"{self.router.url}/api/pool", timeout=5).json()
        return data


