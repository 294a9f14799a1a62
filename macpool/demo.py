"""``macpool demo``: a whole simulated pool on this machine in one command.

An embedded Redis-protocol server (unless ``--redis-url``), N simulated Macs of mixed sizes, one agent
per simulated Mac, and the router with its dashboard - each a process group with its log in one
temporary folder. ``--load`` drives bounded traffic above the pool's capacity so queueing and 503s
show. Ctrl-C or SIGTERM stops everything; a second one kills what is left at once.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool.dev.redis_server import RedisServerError
from macpool.dev.stack import Proc, ProcessError, Stack, free_port
from macpool.loops import wait_event

# A heterogeneous pool: the seed's big Mac, a mid-size one with a larger model, a small one.
PRESETS = ("m5max-128g-14b-q4", "m4max-64g-32b-q4", "m2pro-32g-8b-q4")
DEMO_MODEL = "macpool-demo"  # every simulated Mac serves it, so the whole pool shares the load
# keys and channel of the demo's pool: on a Redis given with --redis-url that a real pool uses, the demo's
# Macs would take real traffic, and the node ids mac-1... of real Macs
DEMO_PREFIX = "macpool-demo:"
READY_TIMEOUT_S = 90.0  # generous: seven Python processes start at once on a small machine


def demo_presets() -> list[str]:
    """The mix above, less any preset this simulator build does not ship."""
    from macpool.sim.machine import preset_names

    known = set(preset_names())
    return [p for p in PRESETS if p in known] or sorted(known)


class DemoError(RuntimeError):
    """The demo could not start; the message says which part and where its log is."""


@dataclass(frozen=True)
class DemoSettings:
    nodes: int = 3
    port: int = 8000
    host: str = "127.0.0.1"
    redis_url: str = ""
    load: bool = False
    load_seconds: float = 300.0
    load_factor: float = 1.5
    speed: float = 1.0
    admin_key: str = field(default_factory=lambda: secrets.token_hex(12))
    agent_token: str = field(default_factory=lambda: secrets.token_hex(16))
    heartbeat_interval: float = 1.0
    trusted_network: bool = False  # a router beyond loopback with no client keys (docs/security.md)


@dataclass
class Pool:
    """The processes of one demo, on the process harness; ``stop`` ends them all."""

    settings: DemoSettings
    log_dir: Path
    stack: Stack = field(init=False)

    def __post_init__(self) -> None:
        # clean_env: the demo is what its flags say; a MACPOOL_* setting left in this shell (a router's keys
        # file, an agent's cap) would change the pool it starts and the snippets it prints
        self.stack = Stack(logs=self.log_dir, keep_logs=True, clean_env=True)

    @property
    def reach_host(self) -> str:
        # a wildcard bind is reached (and loaded, with --load) through loopback
        return "127.0.0.1" if self.settings.host in ("0.0.0.0", "::", "") else self.settings.host

    @property
    def router_url(self) -> str:
        return f"http://{self.reach_host}:{self.settings.port}"

    def start(self, say: Callable[[str], None]) -> None:
        """Start every process (they start together), then wait until each serves and the router sees every
        node; runs in a thread while ``stop`` may come from a signal."""
        try:
            self._start(say)
        except ProcessError as exc:
            raise DemoError(str(exc)) from None

    def _start(self, say: Callable[[str], None]) -> None:
        s, stack = self.settings, self.stack
        redis_url = stack.redis(s.redis_url)
        if not s.redis_url:
            say(f"redis      {redis_url} (embedded)")
        presets = demo_presets()
        sims = [
            stack.sim(
                f"sim-{i + 1}", "--preset", presets[i % len(presets)], "--alias", DEMO_MODEL, "--metrics",
                "--speed", str(s.speed), wait=False,
            )
            for i in range(s.nodes)
        ]
        for i, sim in enumerate(sims):
            port = free_port()
            stack.agent(
                f"agent-{i + 1}", sim.url, redis_url, f"mac-{i + 1}", "--key-prefix", DEMO_PREFIX,
                "--advertise-url", f"http://127.0.0.1:{port}",
                "--heartbeat-interval", str(s.heartbeat_interval), port=port, wait=False,
                env={"MACPOOL_AGENT_TOKEN": s.agent_token},  # not as a flag: ps shows every process's flags
            )
        stack.router(
            "router", redis_url, "--key-prefix", DEMO_PREFIX, "--host", s.host,
            *(["--trusted-network"] if s.trusted_network else []),
            "--shutdown-timeout", "3",  # Ctrl-C ends a demo's long streams soon, with an SSE error event
            port=s.port, host=self.reach_host, wait=False,
            env={"MACPOOL_ADMIN_KEY": s.admin_key, "MACPOOL_AGENT_TOKEN": s.agent_token},
        )
        stack.wait_serving(timeout=READY_TIMEOUT_S)
        stack.wait_nodes(self.router_url, s.nodes, timeout=READY_TIMEOUT_S, key=s.admin_key)

    def dead(self) -> list[Proc]:
        return self.stack.dead()

    def stop(self) -> None:
        """Router first (no new work), then agents (they leave the pool), sims, Redis last."""
        self.stack.stop()

    def kill(self) -> None:
        self.stack.kill()


def models_of(router_url: str) -> list[str]:
    response = httpx.get(f"{router_url}/v1/models", timeout=5)
    return [m["id"] for m in response.json().get("data", [])]


def commands() -> tuple[str, str]:
    """This install's python and macpool, spelled so that they work without an activated venv."""
    python = sys.executable
    script = Path(python).with_name("macpool")
    return python, str(script) if script.exists() else f"{python} -m macpool.cli"


def banner(pool: Pool, models: list[str]) -> str:
    s = pool.settings
    python, macpool = commands()
    url = pool.router_url
    model = models[0] if models else "default"
    body = (
        f'{{"model": "{model}", "stream": true, "max_tokens": 64, '
        f'"messages": [{{"role": "user", "content": "Say hello from the pool"}}]}}'
    )
    return f"""
macpool demo: {s.nodes} simulated Macs behind one router{" (with --load)" if s.load else ""}
  endpoint    {url}/v1   (OpenAI-compatible; models: {", ".join(models) or "-"})
  dashboard   {url}/dashboard   (admin key for drain/undrain: {s.admin_key})
  terminal    {macpool} top --router {url}
  metrics     {url}/metrics   pool JSON: {url}/api/pool   scale hint: {url}/api/pool/scale
  logs        {pool.log_dir}

curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' \\
  -d '{body}'

{python} -m pip install -q openai   # the OpenAI SDK is not a macpool dependency
{python} - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="unused")
stream = client.chat.completions.create(
    model="{model}", stream=True, max_tokens=64,
    messages=[{{"role": "user", "content": "Say hello from the pool"}}])
for chunk in stream:
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF

Ctrl-C stops everything.
"""


# --- load ------------------------------------------------------------------------------------------

@dataclass
class LoadStats:
    ok: int = 0
    rejected: int = 0
    errors: int = 0


async def drive_load(
    router_url: str, models: list[str], settings: DemoSettings, stop: asyncio.Event
) -> LoadStats:
    """Closed-loop streaming clients, about ``load_factor`` x the pool's capacity, for ``load_seconds``."""
    stats = LoadStats()
    async with httpx.AsyncClient(base_url=router_url, timeout=httpx.Timeout(120, connect=5),
                                 headers={"Authorization": f"Bearer {settings.admin_key}"}) as client:
        capacity = int((await client.get("/api/pool")).json()["pool"]["capacity"])
        workers = max(2, math.ceil(capacity * settings.load_factor))
        deadline = time.monotonic() + settings.load_seconds

        async def worker(n: int) -> None:
            model = models[n % len(models)] if models else None
            while not stop.is_set() and time.monotonic() < deadline:
                body: dict[str, Any] = {
                    "stream": True, "max_tokens": 48 + (n * 17) % 96,
                    "messages": [{"role": "user", "content": f"demo load {n}: tell me about unified memory"}],
                }
                if model:
                    body["model"] = model
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        async for _ in response.aiter_bytes():
                            if stop.is_set():
                                break
                    if response.status_code == 503:
                        stats.rejected += 1
                        await _pause(stop, 0.3)  # keep the pressure on, without a tight loop
                    elif response.status_code < 300:
                        stats.ok += 1
                    else:
                        stats.errors += 1
                        await _pause(stop, 1.0)
                except httpx.HTTPError:
                    stats.errors += 1
                    await _pause(stop, 1.0)

        await asyncio.gather(*(worker(n) for n in range(workers)))
    return stats


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    await wait_event(stop, seconds)


# --- the command -----------------------------------------------------------------------------------

async def serve(pool: Pool, say: Callable[[str], None]) -> None:
    """Run until Ctrl-C/SIGTERM; a second signal kills everything at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            say("second signal: killing everything now")
            pool.kill()
            raise SystemExit(130)
        say("stopping the pool ...")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        starting = asyncio.ensure_future(asyncio.to_thread(pool.start, say))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            return
        stopping.cancel()
        await starting
        models = await asyncio.to_thread(models_of, pool.router_url)
        say(banner(pool, models))
        say("macpool demo: ready")
        load: asyncio.Task[LoadStats] | None = None
        if pool.settings.load:
            load = asyncio.create_task(drive_load(pool.router_url, models, pool.settings, stop))
            say(f"load: above capacity for {pool.settings.load_seconds:.0f}s (watch queued and 503/s)")
        reported: set[str] = set()
        while not stop.is_set():
            await _pause(stop, 1.0)
            for proc in pool.dead():
                if proc.name not in reported:
                    reported.add(proc.name)
                    say(f"warning: {proc.name} exited with {proc.child.returncode()} (log: {proc.log_path})")
            if load is not None and load.done():
                stats = load.result()
                say(f"load finished: {stats.ok} completed, {stats.rejected} rejected (503), "
                    f"{stats.errors} errors")
                load = None
        if load is not None:
            await load
    finally:
        # stop here, not after asyncio.run: a start still running in its thread ends once its children do
        await asyncio.to_thread(pool.stop)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def parse(argv: list[str]) -> DemoSettings:
    p = argparse.ArgumentParser(prog="macpool demo", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3, help="simulated Macs (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="router port (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="router address (default %(default)s)")
    p.add_argument("--redis-url", default="",
                   help=f"use this Redis instead of the embedded one (the demo's keys start {DEMO_PREFIX})")
    p.add_argument("--load", action="store_true", help="drive traffic above capacity so queueing/503s show")
    p.add_argument(
        "--load-seconds", type=float, default=300.0, help="how long --load runs, s (default %(default)s)"
    )
    p.add_argument("--speed", type=float, default=1.0, help="simulator speed factor (default %(default)s)")
    p.add_argument("--admin-key", default="", help="admin key for drain/undrain (default: random)")
    p.add_argument("--trusted-network", action="store_true",
                   help="with --host beyond loopback: serve the LAN with no client API keys "
                   "(docs/security.md)")
    a = p.parse_args(argv)
    if not 1 <= a.nodes <= 32:
        raise DemoError(f"--nodes={a.nodes}: must be between 1 and 32")
    if a.speed <= 0 or a.load_seconds <= 0:
        raise DemoError("--speed and --load-seconds must be > 0")
    extra = {"admin_key": a.admin_key} if a.admin_key else {}
    return DemoSettings(
        nodes=a.nodes, port=a.port, host=a.host, redis_url=a.redis_url, load=a.load,
        load_seconds=a.load_seconds, speed=a.speed, trusted_network=a.trusted_network, **extra,
    )


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def main(argv: list[str]) -> int:
    def say(text: str) -> None:
        print(text, flush=True)

    try:
        settings = parse(argv)
        if _port_taken(settings.host, settings.port):
            raise DemoError(f"port {settings.port} is taken on {settings.host}; choose another with --port")
    except DemoError as exc:
        print(f"macpool demo: {exc}", file=sys.stderr)
        return 2
    pool = Pool(settings, Path(tempfile.mkdtemp(prefix="macpool-demo-")))
    try:
        asyncio.run(serve(pool, say))
    except (DemoError, RedisServerError) as exc:
        print(f"macpool demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        pool.stop()
        say(f"macpool demo: stopped (logs kept in {pool.log_dir})")
    return 0
