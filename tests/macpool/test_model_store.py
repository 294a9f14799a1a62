"""macpool/store/models.py: the pool's declared models and the Macs' claims on their replicas, against a real
Redis, with the time passed in."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from macpool.contract import DeclaredModel
from macpool.store import Keys
from macpool.store.models import ModelStore

LEASE = 10_000
NOW = 1_000_000


def with_models(redis_url: str, scenario: Callable[[ModelStore], Awaitable[None]]) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_url)
        try:
            await scenario(ModelStore(redis, Keys("macpool:{t}:")))
        finally:
            await redis.aclose()

    asyncio.run(run())


def test_declared_models_are_listed_by_name_and_replaced_by_a_new_declaration(redis_url: str) -> None:
    async def scenario(models: ModelStore) -> None:
        await models.declare(DeclaredModel(name="qwen", ref="org/qwen-GGUF:Q4_K_M", replicas=2))
        await models.declare(DeclaredModel(name="gemma", ref="org/gemma-GGUF/g.gguf"))
        await models.declare(DeclaredModel(name="qwen", ref="org/qwen-GGUF:Q8_0", replicas=3))
        declared = await models.declared()
        assert list(declared) == ["gemma", "qwen"]
        assert (declared["qwen"].ref, declared["qwen"].replicas) == ("org/qwen-GGUF:Q8_0", 3)
        written = {key.decode() for key in await models.redis.keys("*")}
        assert written == {"macpool:{t}:models"}

    with_models(redis_url, scenario)


def test_the_last_replica_goes_to_one_mac_and_a_lapsed_claim_frees_it(redis_url: str) -> None:
    async def scenario(models: ModelStore) -> None:
        await models.declare(DeclaredModel(name="m", ref="org/r:Q4_K_M", replicas=1))
        first, second = await asyncio.gather(models.claim("m", "mac-a", LEASE, 0, now=NOW),
                                             models.claim("m", "mac-b", LEASE, 0, now=NOW))
        assert sorted([first, second]) == ["claimed", "taken"]
        holder = "mac-a" if first == "claimed" else "mac-b"
        other = "mac-b" if holder == "mac-a" else "mac-a"
        assert await models.holders("m", now=NOW) == [holder]
        assert await models.claim("m", holder, LEASE, 1, now=NOW + 5_000) == "claimed"  # renewed
        assert await models.claim("m", other, LEASE, 0, now=NOW + 12_000) == "taken"
        # the holder stops renewing: once its lease lapses, the replica is the other Mac's
        assert await models.claim("m", other, LEASE, 0, now=NOW + 15_001) == "claimed"
        assert await models.holders("m", now=NOW + 15_001) == [other]

    with_models(redis_url, scenario)


def test_of_the_macs_wanting_a_replica_the_one_holding_fewest_models_takes_it(redis_url: str) -> None:
    """Each Mac wants the replica for the settling time before it may take it; meanwhile every Mac that
    would take it says so, and the one holding the fewest models then takes it, whichever asked first."""
    settle = 2_000

    async def scenario(models: ModelStore) -> None:
        await models.declare(DeclaredModel(name="m", ref="org/r:Q4_K_M", replicas=1))
        assert await models.claim("m", "busy-mac", LEASE, 3, settle, now=NOW) == "wait"
        assert await models.claim("m", "idle-mac", LEASE, 0, settle, now=NOW + 500) == "wait"
        # the busy Mac has waited long enough, but the idle one wants it too
        assert await models.claim("m", "busy-mac", LEASE, 3, settle, now=NOW + 2_000) == "wait"
        assert await models.claim("m", "idle-mac", LEASE, 0, settle, now=NOW + 2_500) == "claimed"
        assert await models.claim("m", "busy-mac", LEASE, 3, settle, now=NOW + 3_000) == "taken"
        # a second replica: the busy Mac wanted one before, afresh now, and alone it takes it when settled
        await models.declare(DeclaredModel(name="m", ref="org/r:Q4_K_M", replicas=2))
        assert await models.claim("m", "busy-mac", LEASE, 3, settle, now=NOW + 4_000) == "wait"
        assert await models.claim("m", "busy-mac", LEASE, 3, settle, now=NOW + 6_000) == "claimed"
        assert await models.holders("m", now=NOW + 6_000) == ["busy-mac", "idle-mac"]

    with_models(redis_url, scenario)


def test_a_removed_model_is_forgotten_with_its_last_replica(redis_url: str) -> None:
    async def scenario(models: ModelStore) -> None:
        await models.declare(DeclaredModel(name="m", ref="org/r:Q4_K_M", replicas=2))
        assert await models.claim("m", "mac-a", LEASE, 0, now=NOW) == "claimed"
        assert await models.claim("m", "mac-b", LEASE, 0, now=NOW) == "claimed"
        removing = await models.remove("m")
        assert removing is not None and removing.removing
        assert await models.claim("m", "mac-c", LEASE, 0, now=NOW) == "gone"  # no new replica of it
        assert await models.claim("m", "mac-a", LEASE, 0, now=NOW) == "gone"
        assert not await models.release("m", "mac-a", now=NOW)
        assert "m" in await models.declared()
        assert await models.release("m", "mac-b", now=NOW)
        assert await models.declared() == {}
        assert await models.redis.keys("*") == []
        assert await models.remove("m") is None

    with_models(redis_url, scenario)
