"""The elastic pool's part of the store: what the autoscaler wants of each node, its leader lease, the Macs
it knows how to wake, and its decisions on the events channel. Key names are :mod:`macpool.store.keys`'."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from macpool.store.connect import AnyRedis
from macpool.store.events import autoscale_message
from macpool.store.keys import Keys
from macpool.store.scripts import source

Mode = Literal["active", "standby"]
MODES: tuple[Mode, ...] = ("active", "standby")


class WakeTarget(BaseModel):
    """A standby-capable Mac the autoscaler has seen, and how to wake it when its heartbeat is gone."""

    node_id: str
    wol_mac: str = ""
    wol_broadcast: str = ""
    models: list[str] = []
    standby_capacity: int = 0


@dataclass(frozen=True)
class LoadAsk:
    """One router's ask that a node load a model (``{p}loading:{model}``): the node, and the marker's value,
    unique to the ask."""

    node_id: str
    marker: str


class ElasticStore:
    """The autoscaler's keys in the Redis that ``redis`` points at, under ``keys``' prefix."""

    def __init__(self, redis: AnyRedis, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._leader = redis.register_script(source("leader"))
        self._resign = redis.register_script(source("resign"))
        self._load = redis.register_script(source("load"))

    # --- what a node should be ---------------------------------------------------------------------

    async def desired(self, node_id: str) -> Mode | None:
        """``active``, ``standby``, or None (nothing asked: the agent keeps the mode it started in)."""
        raw = await self.redis.get(self.keys.desired(node_id))
        mode = raw.decode() if isinstance(raw, bytes) else raw
        return mode if mode in MODES else None

    async def set_desired(self, node_id: str, mode: Mode) -> None:
        if mode not in MODES:
            raise ValueError(f"desired mode {mode!r}: expected one of {', '.join(MODES)}")
        await self.redis.set(self.keys.desired(node_id), mode)

    async def load_once(self, model: str, node_id: str, hold_ms: int, over: LoadAsk | None = None) -> bool:
        """Ask ``node_id`` to load ``model`` unless a load of it was asked for in the last ``hold_ms`` (the
        ask ``over``, found over, does not count); True when this call asked."""
        keys = [self.keys.loading(model), self.keys.desired(node_id)]
        ask = f"{node_id}\t{secrets.token_hex(8)}"
        return bool(await self._load(keys=keys, args=[ask, hold_ms, over.marker if over else ""]))

    async def loading(self, model: str) -> LoadAsk | None:
        """The ask to load ``model`` that holds, if one does."""
        raw = await self.redis.get(self.keys.loading(model))
        if raw is None:
            return None
        marker = _text(raw)
        return LoadAsk(marker.partition("\t")[0], marker)

    # --- the one controller that acts --------------------------------------------------------------

    async def lead(self, holder: str, lease_ms: int) -> bool:
        """Take or renew the leader lease (SET NX PX, renewed by its holder only): True while ``holder``
        is the one controller that acts."""
        return int(await self._leader(keys=[self.keys.autoscale_leader], args=[holder, lease_ms])) == 1

    async def resign(self, holder: str) -> None:
        """Give the lease up on a clean stop, so another controller takes over at once."""
        await self._resign(keys=[self.keys.autoscale_leader], args=[holder])

    async def leader(self) -> str | None:
        raw = await self.redis.get(self.keys.autoscale_leader)
        return raw.decode() if isinstance(raw, bytes) else raw

    # --- Macs that can be woken --------------------------------------------------------------------

    async def remember(self, target: WakeTarget) -> None:
        await self.redis.hset(self.keys.autoscale_known, target.node_id, target.model_dump_json())

    async def known(self) -> dict[str, WakeTarget]:
        raw = await self.redis.hgetall(self.keys.autoscale_known)
        return {_text(k): WakeTarget.model_validate_json(v) for k, v in raw.items()}

    # --- decisions ---------------------------------------------------------------------------------

    async def announce(self, decision: dict[str, object]) -> None:
        """Publish one decision on the pool's events channel (routers ignore kinds they do not know)."""
        await self.redis.publish(self.keys.events, autoscale_message(decision))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
