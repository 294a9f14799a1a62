"""Nothing leaks, whatever ends a request: a bounded mix of requests whose clients leave at random points,
under faults (agent kill -9 and restart, simulator kill -9 and restart, a hung agent, Redis restarted empty,
a drain). Afterwards: no reservation or queue entry in Redis, every agent and simulator idle, the router's
gauges at 0, its asyncio tasks and file descriptors back to where they were, and every client that stayed
got an answer."""

from __future__ import annotations

import json
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from macpool.dev.procs import Child
from macpool.dev.redis_server import RedisServer, free_port
from macpool.dev.stack import Stack
from tests.conftest import Server, SpawnFactory, metric
from tests.reliability.conftest import ADMIN_KEY, AGENT_TOKEN, HEARTBEAT, Node, Rig, assert_clean, wait_until

pytestmark = pytest.mark.slow

TASK_COUNT = str(Path(__file__).with_name("task_count.py"))
REQUESTS = 120
CLIENTS = 12
JSON = {"content-type": "application/json"}
LEAVES = ("stays", "before_body", "queued", "first_byte", "mid_stream")


def counted(spawn: SpawnFactory, *args: str, name: str, port: int | None = None) -> Server:
    """``macpool <args>`` that prints its asyncio task count on SIGUSR1 (task_count.py)."""
    port = port or free_port()
    argv = [sys.executable, TASK_COUNT, *args, "--port", str(port)]
    return spawn(argv=argv, port=port, name=name)


def tasks(child: Child) -> int:
    """The task count ``child`` (started through task_count.py) prints when asked."""
    assert child.log_path is not None
    asked = child.log_path.read_text().count("tasks ")
    child.signal(signal.SIGUSR1)
    lines = wait_until(
        lambda: (found := [ln for ln in child.log_path.read_text().splitlines() if ln.startswith("tasks ")])
        and len(found) > asked and found,
        5, "the task count",
    )
    return int(lines[-1].split()[1])


def sockets(child: Child) -> tuple[int, int]:
    """(open file descriptors, TCP connections in CLOSE_WAIT: closed by the peer, never by this process)."""
    process = psutil.Process(child.pid)
    close_wait = sum(1 for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_CLOSE_WAIT)
    return process.num_fds(), close_wait


def request(i: int, client: httpx.Client, model: str, internal: tuple[str, ...]) -> tuple[str, str]:
    """One client: (how it left, what it got) - ``ok``, ``error <code>``, ``sse <code>``, ``left``."""
    rng = random.Random(i)
    stream, n = rng.random() < 0.6, 2 if rng.random() < 0.25 else 1
    leave = rng.choices(LEAVES, weights=(50, 8, 12, 12, 18))[0]
    if leave == "mid_stream" and not stream:
        leave = "first_byte"
    prompt = [{"role": "user", "content": "hi " * rng.randint(1, 60)}]
    body: dict[str, Any] = {"model": model, "messages": prompt, "stream": stream, "ignore_eos": True, "n": n,
                            "max_tokens": rng.randint(10, 40) if leave == "stays" else 300}
    data = json.dumps(body).encode()
    if leave == "before_body":
        with socket.create_connection(("127.0.0.1", client.base_url.port or 80), timeout=5) as sock:
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: {len(data)}\r\n\r\n"
            sock.sendall(head.encode() + data[: rng.randrange(len(data))])
            time.sleep(rng.random() * 0.2)
        return leave, "left"
    read = {"queued": rng.uniform(0.02, 0.3), "first_byte": rng.uniform(0.1, 0.6)}.get(leave, 30.0)
    try:
        with client.stream("POST", "/v1/chat/completions", content=data, headers=JSON,
                           timeout=httpx.Timeout(30.0, read=read)) as response:
            if leave == "mid_stream" and response.status_code == 200:
                chunks = response.iter_raw()
                for _ in range(rng.randint(1, 5)):
                    next(chunks, None)
                return leave, "left"
            raw = response.read()
    except httpx.TimeoutException:
        if leave == "stays":
            raise
        return leave, "left"
    assert_clean(raw, *internal)
    if response.status_code != 200:
        error = json.loads(raw)["error"]
        assert set(error) >= {"message", "type", "code"}, raw
        return leave, f"error {error['code']}"
    if not stream:
        assert len(json.loads(raw)["choices"]) == n, raw
        return leave, "ok"
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    if events[-1] == "[DONE]":
        return leave, "ok"
    return leave, f"sse {json.loads(events[-1])['error']['code']}"  # a clean error event, nothing else


def test_nothing_leaks_whatever_ends_a_request(stack: Stack, own_redis: RedisServer) -> None:
    rig = Rig(stack, own_redis.url)

    def agent(node_id: str, upstream: str, port: int | None = None) -> Server:
        return counted(rig.spawn, "agent", "run", "--upstream", upstream, "--redis-url", own_redis.url,
                       "--node-id", node_id, "--cap", "3", "--token", AGENT_TOKEN,
                       "--heartbeat-interval", HEARTBEAT, name=f"agent-{node_id}", port=port)

    sims = [rig.sim(f"n{i}", parallel=6, speed=5) for i in (1, 2, 3)]
    nodes = [Node(f"n{i}", sim, agent(f"n{i}", sim.url)) for i, sim in enumerate(sims, 1)]
    router_args = ("router", "--redis-url", own_redis.url, "--agent-token", AGENT_TOKEN,
                   "--admin-key", ADMIN_KEY, "--stale-after", "2", "--refresh-interval", "0.5",
                   "--queue-size", "6", "--queue-timeout", "1", "--idle-timeout", "3",
                   "--first-byte-timeout", "3", "--response-timeout", "5", "--connect-timeout", "1")
    router = counted(rig.spawn, *router_args, name="router")
    rig.wait_ready(router, nodes=3)
    model = rig.model(router)
    internal = tuple(url for node in nodes for url in (node.agent.url, node.sim.url))
    for _ in range(4):  # warm: connections, scripts, lazily created tasks
        assert httpx.post(router.url + "/v1/chat/completions", json={"model": model, "max_tokens": 4,
                          "messages": [{"role": "user", "content": "hi"}]}, timeout=30).status_code == 200
    time.sleep(1.0)
    before = {"router": tasks(router.child), **{n.node_id: tasks(n.agent.child) for n in nodes}}
    fds_before = sockets(router.child)[0]

    def restart_sim(node: Node) -> None:
        node.sim.child.kill()
        time.sleep(0.5)
        node.sim = rig.spawn("sim", "--preset", "m5max-128g-14b-q4", "--parallel", "6", "--speed", "5",
                             port=node.sim.port, name=f"sim-{node.node_id}-again")

    def restart_agent(node: Node) -> None:
        node.agent.child.kill()
        time.sleep(0.5)
        node.agent = agent(node.node_id, node.sim.url, port=node.agent.port)

    def restart_redis() -> None:
        own_redis.stop()
        own_redis.start()

    def admin(action: str) -> None:
        def done() -> bool:  # (the router sees n1 again once its agent has heartbeated into the new Redis)
            reply = httpx.post(f"{router.url}/admin/nodes/n1/{action}", timeout=10,
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            return reply.status_code == 200

        wait_until(done, 10, f"n1 {action}ed")

    faults: list[tuple[float, Callable[[], None]]] = [
        (0.8, lambda: restart_agent(nodes[0])),
        (2.0, lambda: restart_sim(nodes[1])),
        (3.2, lambda: nodes[2].agent.child.signal(signal.SIGSTOP)),  # a hung agent: answers a second late
        (4.2, lambda: nodes[2].agent.child.signal(signal.SIGCONT)),
        (4.8, restart_redis),  # empty
        (6.0, lambda: admin("drain")),
        (7.0, lambda: admin("undrain")),
    ]
    started = time.monotonic()

    def inject() -> None:
        for at, fault in faults:
            time.sleep(max(0.0, started + at - time.monotonic()))
            fault()

    injector = threading.Thread(target=inject)
    injector.start()
    local = threading.local()  # one client per thread: connections are reused until a client leaves
    clients: list[httpx.Client] = []
    try:
        def paced(i: int) -> tuple[str, str]:
            time.sleep(max(0.0, started + i * 0.05 - time.monotonic()))
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=router.url, timeout=30)
                clients.append(local.client)
            return request(i, local.client, model, internal)

        with ThreadPoolExecutor(CLIENTS) as pool:
            outcomes = list(pool.map(paced, range(REQUESTS)))
    finally:
        injector.join()
        nodes[2].agent.child.signal(signal.SIGCONT)
        for client in clients:
            client.close()
    print(f"{REQUESTS} requests in {time.monotonic() - started:.1f}s:",
          dict(Counter(f"{leave}: {got}" for leave, got in outcomes)))
    # the clients that stayed were answered: in full, with a clean error, or with an error event mid-stream
    assert all(got != "left" for leave, got in outcomes if leave == "stays")
    assert sum(1 for leave, got in outcomes if leave == "stays" and got == "ok") >= 20, outcomes

    # settled: nothing held anywhere
    rig.wait_ready(router, nodes=3)
    with rig.store() as store:
        def held() -> dict[str, int]:
            now = int(time.time() * 1000)
            keys = [*store.scan_iter("macpool:{pool}:resv:*"), "macpool:{pool}:inflight",
                    "macpool:{pool}:queue"]
            counts = {str(key): int(store.zcount(key, now, "+inf")) for key in keys}
            return {key: count for key, count in counts.items() if count}

        wait_until(lambda: not held(), 10, "no reservation or queue entry in Redis")
    for node in nodes:
        wait_until(lambda n=node: n.status()["in_flight"] == 0, 10, f"{node.node_id}'s agent idle")
        stats = node.stats()
        assert stats["processing"] == stats["deferred"] == 0, stats
        slots = httpx.get(node.sim.url + "/slots", timeout=5).json()
        assert not [slot for slot in slots if slot["is_processing"]], slots
    busy, queued = 'macpool_pool_slots{state="busy"}', "macpool_queue_depth"
    wait_until(lambda: metric(router.url, busy) == metric(router.url, queued) == 0, 10, "router gauges at 0")
    # the processes are back where they started: their asyncio tasks, their sockets
    wait_until(lambda: tasks(router.child) <= before["router"], 10, "the router's tasks back to their count")
    for node in nodes:  # (the restarted agent's against the most the others had)
        wait_until(lambda n=node: tasks(n.agent.child) <= max(before[m.node_id] for m in nodes), 10,
                   f"{node.node_id}'s agent's tasks back to their count")
    fds, close_wait = sockets(router.child)
    # (the router keeps idle connections to agents for reuse: a few more than before are fine)
    assert fds <= fds_before + 10 and close_wait == 0, (fds_before, fds, close_wait)
    for node in nodes:
        assert sockets(node.agent.child)[1] == 0
