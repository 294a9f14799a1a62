"""The pool's desired state: which models it serves and on how many Macs (``macpool models``), and which Macs
hold a replica of each. Key names are :mod:`macpool.store.keys`'; the claim is one script (claim.lua), so that
two Macs never both take the last replica."""

from __future__ import annotations

from typing import Literal, cast, get_args

from macpool.contract import DeclaredModel, now_ms
from macpool.store.connect import AnyRedis
from macpool.store.keys import Keys
from macpool.store.scripts import source

ClaimStatus = Literal["claimed", "taken", "wait", "gone"]


class ModelStore:
    """The declared models in the Redis that ``redis`` points at, under ``keys``' prefix."""

    def __init__(self, redis: AnyRedis, keys: Keys | None = None) -> None:
        self.redis = redis
        self.keys = keys or Keys()
        self._claim = redis.register_script(source("claim"))
        self._unclaim = redis.register_script(source("unclaim"))

    # --- the operator's side -----------------------------------------------------------------------

    async def declare(self, model: DeclaredModel) -> None:
        """Serve ``model`` (a new one, or new replicas or reference for one declared already)."""
        await self.redis.hset(self.keys.models, model.name, model.encode())

    async def remove(self, name: str) -> DeclaredModel | None:
        """Mark ``name`` as being removed: the Macs holding it drain it, unload it and give their replica
        back, the last one forgetting it. None when it is not declared."""
        model = await self.get(name)
        if model is None:
            return None
        removing = model.model_copy(update={"removing": True})
        await self.redis.hset(self.keys.models, name, removing.encode())
        return removing

    async def forget(self, name: str) -> None:
        """Drop ``name`` and its claims at once (a removal no Mac finishes: every one holding it is gone)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.models, name)
            pipe.delete(self.keys.model_claims(name), self.keys.model_wants(name))
            await pipe.execute()

    async def get(self, name: str) -> DeclaredModel | None:
        raw = await self.redis.hget(self.keys.models, name)
        return None if raw is None else DeclaredModel.decode(raw)

    async def declared(self) -> dict[str, DeclaredModel]:
        """Every declared model, by name."""
        raw = await self.redis.hgetall(self.keys.models)
        models = (DeclaredModel.decode(v) for v in raw.values())
        return {m.name: m for m in sorted(models, key=lambda m: m.name)}

    async def holders(self, name: str, now: int | None = None) -> list[str]:
        """The Macs (agent node ids) whose claim on a replica of ``name`` holds now."""
        now = now_ms() if now is None else now
        raw = await self.redis.zrangebyscore(self.keys.model_claims(name), f"({now}", "+inf")
        return sorted(_text(cast(str | bytes, member)) for member in raw)

    # --- the agents' side --------------------------------------------------------------------------

    async def claim(self, name: str, agent: str, lease_ms: int, load: int, settle_ms: int = 0,
                    now: int | None = None) -> ClaimStatus:
        """Take a replica of ``name`` for ``agent`` (which holds ``load`` declared models already), or renew
        the one it holds, for ``lease_ms``, in one atomic call. A new replica is taken once the Mac has
        wanted it for ``settle_ms``, and only by the Mac holding fewest models of those wanting it then
        (claim.lua says each answer)."""
        keys = [self.keys.models, self.keys.model_claims(name), self.keys.model_wants(name)]
        now = now_ms() if now is None else now
        raw = await self._claim(keys=keys, args=[name, agent, now, lease_ms, load, settle_ms])
        status = _text(raw)
        if status not in get_args(ClaimStatus):
            raise ValueError(f"claim.lua answered {raw!r}")
        return cast(ClaimStatus, status)

    async def release(self, name: str, agent: str, now: int | None = None) -> bool:
        """Give ``agent``'s replica of ``name`` back; True when that forgot a model being removed."""
        keys = [self.keys.models, self.keys.model_claims(name), self.keys.model_wants(name)]
        return bool(await self._unclaim(keys=keys, args=[name, agent, now_ms() if now is None else now]))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
