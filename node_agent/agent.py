"""The agent's lifecycle: startup -> main loop -> shutdown (drain, leave the pool, stop llama-server).

Signal handlers only set flags: the first SIGTERM/SIGINT starts a drain bounded by ``--drain-timeout``;
a second one forces exit (llama-server is killed on that path too).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Generator
from pathlib import Path

import httpx
import uvicorn
from starlette.types import ASGIApp

from macpool import upstream
from macpool.gguf_info import GGUFError, ModelShape, cache_types, read_shape
from macpool.loops import every
from macpool.serving import server_config, tls_options
from macpool.settings import ConfigError
from macpool.store import Keys
from macpool.store.connect import AnyRedis, Connection, connect
from macpool.store.elastic import ElasticStore
from macpool.store.models import ModelStore

from . import kv, models, sizing
from .gateway import create_app, create_models_app
from .heartbeat import Heartbeat
from .hub import fetch_models
from .memory import LinuxProbe, MacProbe, MemoryProbe, MemorySample, ProbeError, SharedProbe, make_probe
from .pool_models import PoolModels
from .runtime import Runtime
from .settings import AgentSettings
from .standby import Standby
from .supervisor import Supervisor

log = logging.getLogger("macpool.agent")

KEEP_ALIVE_S = 60  # how long the gateway keeps an idle client (router) connection open
UPSTREAM_IDLE_S = 4.0  # how long an idle connection to llama-server is kept for reuse


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the agent decides what a signal means."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the gateway's port before anything starts, so a taken port is a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then (else Nagle and
    # delayed ACKs hold every small response back by a delayed-ACK timeout)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host/--port {host}:{port}: cannot listen ({exc.strerror})") from exc
    return sock  # not inheritable (Python's default): llama-server must never hold the agent's port


def load_model_shape(settings: AgentSettings) -> tuple[ModelShape | None, int | None]:
    """The GGUF's attention shape and KV bytes per token; a non-GGUF model file just means no estimate."""
    if settings.model_file is None:
        return None, None
    try:
        shape = read_shape(settings.model_file)
        return shape, shape.kv_bytes_per_token(*cache_types(settings.llama_args))
    except GGUFError as exc:
        log.warning("no KV estimate from the model file: %s", exc)
        return None, None


async def probed_memory(settings: AgentSettings) -> MemorySample | None:
    """This machine's memory, before llama-server starts (the simulator's is known only once it runs)."""
    probe: MemoryProbe
    if settings.memory_probe == "macos" or (settings.memory_probe == "auto" and sys.platform == "darwin"):
        probe = MacProbe()
    elif settings.memory_probe in ("linux", "auto"):
        probe = LinuxProbe()
    else:
        return None
    try:
        return await probe.sample()
    except (ProbeError, OSError) as exc:
        log.warning("no memory figures to size llama-server by: %s", exc)
        return None


class Agent:
    """One node agent: the gateway, the heartbeat and (in supervise mode) llama-server."""

    def __init__(self, settings: AgentSettings, sock: socket.socket) -> None:
        self.settings = settings
        self.sock = sock
        self.runtime = Runtime(settings)
        self.stop_requested = asyncio.Event()
        self.force = asyncio.Event()
        self.supervisor: Supervisor | None = None
        self.redis: AnyRedis | None = None
        self.connection: Connection | None = None
        self.server: _Server | None = None
        self.server_task: asyncio.Task[None] | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self._llama_task: asyncio.Task[None] | None = None
        self.heartbeats: list[Heartbeat] = []  # one, or one per model (--models)
        self.models: models.ModelHost | None = None
        self.preset_dir: tempfile.TemporaryDirectory[str] | None = None
        self.shape: ModelShape | None = None
        self.runtimes: dict[str, Runtime] = {}  # each model's node (several models): the gateway's table
        self.preset = Path()
        self.wired_limit: float | None = None
        self.shared_probe: SharedProbe | None = None
        self.pool_models: PoolModels | None = None
        self.kv_per_token: int | None = None
        self.prepared = False

    async def run(self) -> int:
        """prepare -> startup -> main loop -> shutdown; returns the exit code."""
        self._install_signals()
        await self.prepare()
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()
        return 0

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        if self.stop_requested.is_set():
            log.warning("second signal: forcing exit")
            self.force.set()
        self.stop_requested.set()

    async def prepare(self) -> None:
        """What the model file says and, in supervise mode, llama-server's slots: a Mac that cannot hold one
        request at the context asked for is refused here (ConfigError), before anything starts."""
        if self.prepared:
            return
        self.prepared = True
        settings = self.settings
        if settings.multi_model:
            return
        self.shape, self.kv_per_token = shape, kv_per_token = load_model_shape(settings)
        if not settings.supervise:
            return
        memory = await probed_memory(settings)
        wired_limit = settings.wired_limit_gb or (memory.wired_limit_gb if memory else None)
        weights = shape.weights_gb if shape else None
        chosen = sizing.choose(
            parallel=settings.parallel,
            ctx_per_slot=settings.ctx_per_slot,
            wired_limit_gb=wired_limit,
            weights_gb=weights,
            headroom_gb=settings.headroom_gb,
            kv_bytes_per_token=kv_per_token,
            calibrated_cap=settings.calibrated_cap,
            n_ctx_train=shape.n_ctx_train if shape else None,
        )
        if wired_limit is not None and kv_per_token:
            refusal = sizing.cannot_hold(chosen, weights, settings.headroom_gb, wired_limit, kv_per_token)
            if refusal is not None:  # it would page from its first request: better not start at all
                raise ConfigError(refusal)
        operator = sizing.operator_cache_ram(settings.llama_args, os.environ)
        if operator is not None:
            chosen = dataclasses.replace(chosen, cache_ram=f"the operator's ({operator})")
        elif memory is not None and weights is not None and kv_per_token:
            chosen = sizing.prompt_cache(chosen, total_gb=memory.total_gb, weights_gb=weights,
                                         kv_bytes_per_token=kv_per_token, headroom_gb=settings.headroom_gb,
                                         reserve_gb=settings.host_reserve_gb)
        self._set_sizing(chosen)

    async def startup(self) -> None:
        await self.prepare()
        settings = self.settings
        timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout)
        # idle connections are given up after 4 s, before llama-server (Keep-Alive: timeout=5) or a simulator
        # on uvicorn (5 s) may close them: reusing one as the server closes it fails a request
        transport = upstream.Upstream(UPSTREAM_IDLE_S)
        self.runtime.http = httpx.AsyncClient(timeout=timeout, transport=transport)
        self.runtime.upstream_transport = transport
        self.connection = connect(settings.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                  health_check_interval=10)
        self.redis = self.connection.client
        app = await self._start_models() if settings.multi_model else await self._start_one()
        if self.connection.sentinel is not None:  # a failover, logged when the sentinels name a new primary
            watch = functools.partial(self.connection.check_primary, log)
            self.tasks.append(asyncio.create_task(every(1.0, watch, "redis primary", log, first_now=True),
                                                     name="redis primary"))
        config = server_config(
            app,
            # longer than the routers keep an idle connection (30 s, router/forward.py), so a router never
            # reuses one the agent is closing
            keep_alive=KEEP_ALIVE_S,
            graceful_shutdown=1,
            lifespan="off",
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # its clients are routers: X-Forwarded-* says nothing it uses
            **tls_options(settings.tls_cert, settings.tls_key, settings.tls_client_ca),
        )
        self.server = server = _Server(config)
        self.server_task = asyncio.create_task(server.serve(sockets=[self.sock]))
        log.info(
            "agent %s serving on %s (upstream %s)",
            settings.node_id,
            settings.public_url,
            self.runtime.upstream_url,
        )

    async def _start_one(self) -> ASGIApp:
        """One model: this node's heartbeat and standby follower, and the gateway over its runtime."""
        settings, redis = self.settings, self.redis
        assert redis is not None
        shape, kv_per_token = self.shape, self.kv_per_token
        self.runtime.details["model"] = {
            "path": str(settings.model_file) if settings.model_file else None,
            "kv_bytes_per_token": kv_per_token,
            "weights_gb": shape.weights_gb if shape else None,
        }
        if settings.supervise:
            if not settings.standby:
                self._start_llama_server()
        else:
            assert settings.upstream is not None
            self.runtime.upstream_url = settings.upstream.rstrip("/")
        probe = make_probe(settings.memory_probe, self.runtime.client(), lambda: self.runtime.upstream_url)
        heartbeat = Heartbeat(self.runtime, redis, probe, shape, kv_per_token,
                              on_persistent_pressure=self._shrink if settings.supervise else None)
        if settings.supervise:
            heartbeat.kv_source = self._supervised_args
        else:
            assert settings.upstream is not None
            heartbeat.kv_source = functools.partial(kv.attached_async, settings.upstream, settings.llama_args)
        if settings.follows_autoscaler:
            store = ElasticStore(redis, Keys(settings.key_prefix))
            standby = Standby(self.runtime, store, self._start_llama_server, self._stop_llama_server)
            heartbeat.before_beat = standby.follow
        self._beat(heartbeat)
        return create_app(self.runtime)

    async def _start_models(self) -> ASGIApp:
        """Several models (node_agent/models.py): llama-server's router mode, and a node per model; with
        --from-pool, the models the pool declares come and go while it runs (node_agent/pool_models.py)."""
        settings, redis = self.settings, self.redis
        assert redis is not None
        memory = await probed_memory(settings) if settings.wired_limit_gb is None else None
        wired_limit = settings.wired_limit_gb or (memory.wired_limit_gb if memory else None)
        self.wired_limit = wired_limit
        specs = models.plan_models(settings, wired_limit)
        budget = models.Budget(None if wired_limit is None else wired_limit - settings.headroom_gb)
        if budget.limit_gb is None:
            log.warning("no wired limit known (--wired-limit-gb): models are loaded with no memory budget")
        self.preset_dir = models.preset_dir()
        self.preset = Path(self.preset_dir.name) / "models.ini"
        models.write_preset(self.preset, specs)
        store = ElasticStore(redis, Keys(settings.key_prefix))
        host = self.models = models.ModelHost(settings, self.runtime, store, budget)
        self._start_llama_server(self.preset)
        # one memory sample per heartbeat interval for the whole Mac, read by every model's heartbeat
        self.shared_probe = SharedProbe(make_probe(settings.memory_probe, self.runtime.client(),
                                                   lambda: host.runtime.upstream_url),
                                        settings.heartbeat_interval / 2)
        for spec in specs:
            self._beat_model(spec)
        if settings.from_pool:
            self.pool_models = PoolModels(settings, ModelStore(redis, Keys(settings.key_prefix)), redis, self)
            self.tasks.append(asyncio.create_task(self.pool_models.run(), name="pool models"))
        return create_models_app(self.runtimes, self.runtime)

    def _beat_model(self, spec: models.ModelSpec) -> None:
        """``spec``'s node: a unit of the model host, its heartbeat and standby follower."""
        host, redis, probe = self.models, self.redis, self.shared_probe
        assert host is not None and redis is not None and probe is not None
        unit = host.add(spec, models.unit_settings(self.settings, spec))
        self.runtimes[spec.name] = unit.runtime
        heartbeat = Heartbeat(unit.runtime, redis, probe, None, None, host.relieve_pressure,
                              model_memory_gb=spec.memory_gb,
                              load_cost=functools.partial(host.load_cost, unit))
        heartbeat.before_beat = host.standby_for(unit).follow
        heartbeat.kv_source = functools.partial(_preset_args, spec, self.settings.llama_args)
        self._beat(heartbeat)

    # --- models the pool declares (node_agent/pool_models.py) ----------------------------------------
    def plan(self, name: str, path: Path) -> tuple[models.ModelSpec, str | None]:
        """A downloaded model's slots and memory, and why the Mac cannot hold it (None: it can)."""
        spec = models.plan_model(self.settings, name, path, self.wired_limit)
        return spec, models.cannot_hold(self.settings, spec, self.wired_limit)

    @property
    def budget_gb(self) -> float | None:
        return self.models.budget.limit_gb if self.models is not None else None

    def hosts(self, name: str) -> bool:
        return self.models is not None and name in self.models.units

    async def add_model(self, spec: models.ModelSpec) -> None:
        """Serve ``spec`` from now on: in llama-server's presets, and a node of the pool (in standby)."""
        host = self.models
        assert host is not None
        specs = [u.spec for u in host.units.values()] + [spec]
        models.write_preset(self.preset, specs)
        await host.reload()
        self._beat_model(spec)

    async def remove_model(self, name: str) -> None:
        """Stop serving ``name``: its node admits nothing new and finishes what it holds (up to
        --drain-timeout), then its model is unloaded, its node leaves the pool, and llama-server forgets
        it."""
        host = self.models
        assert host is not None
        unit = host.units[name]
        unit.runtime.begin_standby_drain()
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while unit.runtime.in_flight + unit.runtime.light_in_flight > 0:
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("model %s: %d requests still in flight after the drain timeout", name,
                            unit.runtime.in_flight)
                break
            await asyncio.sleep(0.05)
        if unit.held:
            await host.unload(unit)
        heartbeat = next(h for h in self.heartbeats if h.runtime is unit.runtime)
        self.heartbeats.remove(heartbeat)
        task = next(t for t in self.tasks if t.get_name() == f"heartbeat {unit.settings.node_id}")
        self.tasks.remove(task)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await heartbeat.remove()
        del host.units[name]
        self.runtimes.pop(name, None)
        models.write_preset(self.preset, [u.spec for u in host.units.values()])
        await host.reload()

    def _beat(self, heartbeat: Heartbeat) -> None:
        self.heartbeats.append(heartbeat)
        name = f"heartbeat {heartbeat.runtime.settings.node_id}"
        self.tasks.append(asyncio.create_task(heartbeat.run(), name=name))

    def _start_llama_server(self, preset: Path | None = None) -> None:
        """Supervise a new llama-server (at startup, or when a standby node is activated); in router mode
        over ``preset`` with several models."""
        settings = self.settings
        if not settings.supervise:
            return
        host = self.models
        self.supervisor = Supervisor(
            settings.llama_command,
            settings.model_file,
            self.runtime.sizing.parallel if self.runtime.sizing else 1,
            self.runtime.sizing.ctx_per_slot if self.runtime.sizing else settings.ctx_per_slot,
            [*self._cache_ram_args(), *settings.llama_args],
            settings.llama_log,
            settings.restart_backoff_max,
            on_healthy=self._llama_healthy,
            on_exit=host.llama_server_exited if host is not None else self.runtime.llama_down,
            on_url=host.set_upstream if host is not None else self._set_upstream,
            preset=preset,
        )
        self.runtime.upstream_url = self.supervisor.url
        self.runtime.details["llama_server"] = self.supervisor.describe
        run = self.supervisor.run(self.runtime.client())
        self._llama_task = asyncio.create_task(run, name="llama-server")
        self.tasks.append(self._llama_task)

    def _cache_ram_args(self) -> list[str]:
        chosen = self.runtime.sizing
        if chosen is None or chosen.cache_ram_mib is None:
            return []
        return ["--cache-ram", str(chosen.cache_ram_mib)]

    async def _supervised_args(self, slots: int) -> kv.Source:
        supervisor = self.supervisor
        if supervisor is None:  # (stopped between its poll and now: the next start reads them again)
            return kv.Source(kv.LlamaArgs(), "no llama-server running", known=False)
        return kv.supervised(supervisor.argv())

    def _llama_healthy(self) -> None:
        self.runtime.llama_up(self.supervisor.load_s if self.supervisor else None)

    async def _stop_llama_server(self) -> None:
        """Standby: stop the supervised llama-server, giving its memory back to the Mac."""
        supervisor, task = self.supervisor, self._llama_task
        if supervisor is None or task is None:
            return
        await supervisor.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self.tasks.remove(task)
        self.supervisor = self._llama_task = None
        self.runtime.details["llama_server"] = None

    def _set_sizing(self, chosen: sizing.Sizing) -> None:
        self.runtime.sizing = chosen
        self.runtime.details["sizing"] = chosen.as_dict()
        log.info("llama-server sized: %s", chosen.reason)
        if chosen.cache_ram:
            log.info("llama-server's prompt cache (--cache-ram): %s", chosen.cache_ram)

    def _shrink(self, beats: int) -> None:
        """Memory pressure that does not go away: restart llama-server with a quarter fewer slots (its KV
        cache is allocated at start, so only fewer slots give memory back). Never below one slot, and
        never against the operator's --parallel."""
        current, supervisor = self.runtime.sizing, self.supervisor
        if current is None or supervisor is None:
            return
        if current.chosen_by == "operator":
            log.warning("memory pressure for %d heartbeats; --parallel %d was given, so llama-server keeps "
                        "its slots", beats, current.parallel)
            return
        smaller = sizing.shrunk(current, beats)
        if smaller is None:
            log.warning("memory pressure for %d heartbeats with one slot: nothing left to give back", beats)
            return
        log.warning("memory pressure for %d heartbeats: restarting llama-server with %d slots (was %d)",
                    beats, smaller.parallel, current.parallel)
        self._set_sizing(smaller)
        self.runtime.llama_resizing()
        supervisor.resize(smaller.parallel)


    def _set_upstream(self, url: str) -> None:
        self.runtime.upstream_url = url

    async def main_loop(self) -> None:
        server_task = self.server_task
        assert server_task is not None
        stop = asyncio.create_task(self.stop_requested.wait())
        try:
            done, _ = await asyncio.wait({stop, server_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if server_task in done and not self.stop_requested.is_set():
            server_task.result()  # the gateway died on its own: surface why

    async def shutdown(self) -> None:
        """Drain (bounded), leave the pool, stop the gateway and llama-server. Every step runs."""
        try:
            await self._drain()
        finally:
            # the gateway first: a stream still open past the drain timeout is ended by the gateway with an
            # error event now - stopping llama-server first (or its supervising task) would cut it as a
            # llama-server failure, seconds later. Never uvicorn's force_exit, even on a second signal: it
            # would leave the requests running, to be cut by llama-server's kill below as its failure;
            # without it uvicorn cancels them after its own 1 s, and each open stream ends with the
            # gateway's error event.
            if self.server is not None and self.server_task is not None:
                self.server.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.server_task, 3)
            # then the heartbeat: a beat written after remove_node would bring the key back
            for task in self.tasks:
                task.cancel()
            if self.tasks:
                _, running = await asyncio.wait(self.tasks, timeout=5)
                for task in running:  # a bug: shutdown goes on, and says which loop would not end
                    log.error("task %s did not end within 5 s of its cancellation", task.get_name())
            if self.heartbeats:
                removals = [asyncio.wait_for(heartbeat.remove(), 3) for heartbeat in self.heartbeats]
                await asyncio.gather(*removals, return_exceptions=True)
            if self.models is not None:
                await self.models.close()
            if self.supervisor is not None:
                if self.force.is_set():
                    self.supervisor.kill_now()
                await self.supervisor.stop()
            if self.runtime.http is not None:
                await self.runtime.http.aclose()
            if self.connection is not None:
                await self.connection.aclose()
            if self.preset_dir is not None:
                self.preset_dir.cleanup()
            log.info("agent %s stopped", self.settings.node_id)

    async def _drain(self) -> None:
        """Every node of this agent (one, or one per model) admits nothing new and says so; then wait for
        what they hold, up to --drain-timeout."""
        if not self.heartbeats:
            return
        runtimes = [heartbeat.runtime for heartbeat in self.heartbeats]
        for runtime in runtimes:
            runtime.begin_drain()

        def in_flight() -> int:  # light requests too: they are answered in milliseconds, but answered
            return sum(runtime.in_flight + runtime.light_in_flight for runtime in runtimes)

        log.info("draining: %d in flight, up to %.0fs", in_flight(), self.settings.drain_timeout)
        beats = [asyncio.wait_for(heartbeat.beat(), 2) for heartbeat in self.heartbeats]
        await asyncio.gather(*beats, return_exceptions=True)
        deadline = asyncio.get_running_loop().time() + self.settings.drain_timeout
        while in_flight() > 0 and not self.force.is_set():
            if asyncio.get_running_loop().time() >= deadline:
                log.warning("drain timeout: %d requests still in flight", in_flight())
                break
            await asyncio.sleep(0.05)


async def _preset_args(spec: models.ModelSpec, llama_args: list[str], slots: int) -> kv.Source:
    """A model of several: the slots and context of its preset section, and the agent's llama-server
    arguments, which its own process is started with."""
    ctx = spec.sizing.parallel * spec.sizing.ctx_per_slot
    args = ["--parallel", str(spec.sizing.parallel), "--ctx-size", str(ctx), *llama_args]
    return kv.Source(kv.parse_args(args, os.environ), "its preset and the arguments after --")


def run_agent(settings: AgentSettings) -> int:
    """Download the Hugging Face models it names, bind, then run the agent's event loop until it stops."""
    settings = fetch_models(settings)
    sock = bind_socket(settings.host, settings.port)
    if settings.port == 0:
        settings = settings.model_copy(update={"port": sock.getsockname()[1]})
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(Agent(settings, sock).run())
    finally:
        sock.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed (uvicorn[standard] brings it), as in the router; else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
