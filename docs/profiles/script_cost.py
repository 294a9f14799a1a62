"""Redis's own time per call of the admission scripts, for two or more checkouts of macpool side by side (a
profiling aid, not part of the product).

For each checkout, in alternating order every round, on one embedded Redis-protocol server: ``N`` reservations
each followed by its release on an idle pool of ``NODES`` nodes (capacity 4), then ``N`` refused reservations
with every node full and a queue of ``QUEUE`` waiting; ``INFO commandstats`` gives the microseconds per
``EVALSHA``. Prints the median over the rounds of each, and each round's figure.

    .venv/bin/python docs/profiles/script_cost.py /tmp/old-checkout,. 10 500 50 32

(ROUNDS N NODES QUEUE). One Redis serves every router of a pool, so this is the pool's shared budget.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path
from types import ModuleType

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from macpool.redis_server import RedisServer


def contract_of(tree: str) -> ModuleType:
    """``macpool/contract.py`` of the checkout at ``tree``."""
    path = Path(tree) / "macpool" / "contract.py"
    spec = importlib.util.spec_from_file_location(f"contract_{abs(hash(tree))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usec_per_evalsha(r: redis.Redis) -> float:
    return float(r.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])


def measure(r: redis.Redis, c: ModuleType, prefix: str, n: int, nodes: int,
            queue: int) -> tuple[float, float]:
    """(us per call admitting and releasing on an idle pool, us per call refusing with the pool full)."""
    keys = c.Keys(prefix)
    for j in range(nodes):
        r.hset(keys.node(f"n{j}"), mapping={"capacity": 4, "state": "ready", "models": "m", "slots": 4})
    reserve, release = r.register_script(c.RESERVE_OR_ENQUEUE), r.register_script(c.RELEASE)
    candidates = [(f"n{j}", 0.0) for j in range(nodes)]

    def ask(rid: str, queue_lease_ms: int = 3_000) -> list[bytes]:
        args = c.reserve_argv(keys, rid, 600_000, candidates, queue_size=queue, enqueue=True, model="m",
                              queue_lease_ms=queue_lease_ms)
        return list(reserve(args=args))

    r.config_resetstat()
    for k in range(n):
        node = ask(f"a{k}")[1].decode()
        release(args=[keys.prefix, c.now_ms(), 3_000, f"a{k}", node, "anonymous", "0", 1])
    admitted = usec_per_evalsha(r)
    for k in range(nodes * 4):
        ask(f"busy{k}")
    for k in range(queue):
        ask(f"waiting{k}", queue_lease_ms=600_000)
    r.config_resetstat()
    for k in range(n):
        assert ask(f"refused{k}")[0] == b"full"
    return admitted, usec_per_evalsha(r)


def main() -> None:
    trees = sys.argv[1].split(",")
    rounds, n, nodes, queue = (int(a) for a in sys.argv[2:6])
    contracts = {tree: contract_of(tree) for tree in trees}
    figures: dict[str, list[tuple[float, float]]] = {tree: [] for tree in trees}
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        for i in range(rounds):
            for tree in trees if i % 2 == 0 else trees[::-1]:
                prefix = f"{trees.index(tree)}-{i}:"
                figures[tree].append(measure(r, contracts[tree], prefix, n, nodes, queue))
    for tree, rows in figures.items():
        admitted, refused = [a for a, _ in rows], [b for _, b in rows]
        print(f"{tree}: admitted + released {statistics.median(admitted):.1f} us per call "
              f"{[round(a) for a in admitted]}; refused {statistics.median(refused):.1f} us "
              f"{[round(b) for b in refused]}")


if __name__ == "__main__":
    main()
