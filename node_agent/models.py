"""Several models on one Mac: llama-server's router mode, under one memory budget the agent keeps.

The agent runs one llama-server in router mode over a preset file it writes (each model's GGUF, slots and
context), with autoload off and no model limit of llama-server's own: what is loaded is the agent's
decision alone. Each model is a pool node of its own, ``<node-id>/<name>``, reached at
``<agent URL>/m/<name>``, with its own capacity, in-flight count and heartbeat. Each starts in standby.
When a router's load on demand (or the autoscaler) writes ``active`` to its desired key, the agent loads it
if its memory (weights and every slot's KV cache, from the GGUF) fits the budget - the wired limit minus
the headroom - beside the models already loaded. To make room it first unloads idle models, least recently
used first, never one with a request in flight; when even that is not enough the load is refused and the
model stays in standby. ``--idle-unload`` unloads a model after that long without a request, and memory
pressure that lasts ``--shrink-after-beats`` heartbeats (another app took the memory) unloads the least
recently used idle one.

Router mode rather than one supervised llama-server per model: llama-server itself starts, stops and relays
to each model's own process, so one crashing model does not take the others down, and the agent speaks one
documented API (``/models``, ``/models/load``, ``/models/unload``, ``?model=``) instead of keeping a port,
a process group and a restart loop per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import psutil
from redis.exceptions import RedisError

from macpool.contract import LoadCost
from macpool.gguf_info import GGUFError, cache_types, read_shape
from macpool.store.elastic import ElasticStore

from . import sizing
from .heartbeat import model_status
from .memory import GB
from .runtime import Runtime
from .settings import AgentSettings
from .sizing import Sizing
from .standby import Standby

log = logging.getLogger("macpool.agent")

LOAD_TIMEOUT_S = 600.0  # the longest a model's load may take before it counts as failed
LOAD_POLL_S = 0.2
# llama-server force-kills a model's process 10 s (its DEFAULT_STOP_TIMEOUT) after asking it to exit; past
# this the agent stops waiting and counts the memory free
UNLOAD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ModelSpec:
    """One model this Mac can serve: its file, the slots it is loaded with, and the memory that holds."""

    name: str
    path: Path
    sizing: Sizing
    memory_gb: float | None  # weights + every slot's KV cache at its context (None: the file says nothing)


def plan_models(settings: AgentSettings, wired_limit_gb: float | None) -> list[ModelSpec]:
    """Each model's slots, chosen as for one model (node_agent/sizing.py) but at most ``DEFAULT_SLOTS``
    unless ``--parallel`` says: a model sized to the whole Mac would leave no room for another."""
    return [plan_model(settings, name, path, wired_limit_gb) for name, path in settings.model_files.items()]


def plan_model(settings: AgentSettings, name: str, path: Path, wired_limit_gb: float | None) -> ModelSpec:
    """One model's slots and memory (``plan_models``); ``cannot_hold`` says whether the Mac holds it."""
    spec, refusal = _plan(settings, name, path, wired_limit_gb)
    if refusal is not None:  # (the others may still serve: this one will not load)
        log.warning("model %s: %s", name, refusal)
    log.info("model %s: %s; holds %s GB loaded", name, spec.sizing.reason,
             "?" if spec.memory_gb is None else f"{spec.memory_gb:.2f}")
    return spec


def cannot_hold(settings: AgentSettings, spec: ModelSpec, wired_limit_gb: float | None) -> str | None:
    """Why the Mac cannot hold one request of ``spec`` at its context beside its headroom (None: it can)."""
    return _plan(settings, spec.name, spec.path, wired_limit_gb)[1]


def _plan(settings: AgentSettings, name: str, path: Path, wired_limit_gb: float | None
          ) -> tuple[ModelSpec, str | None]:
    try:
        shape = read_shape(path)
        kv_per_token: int | None = shape.kv_bytes_per_token(*cache_types(settings.llama_args))
        weights: float | None = shape.weights_gb
        n_ctx_train: int | None = shape.n_ctx_train
    except GGUFError as exc:
        log.warning("model %s: no memory estimate from its file (%s); the budget counts it as 0", name, exc)
        kv_per_token = weights = n_ctx_train = None
    chosen = sizing.choose(
        parallel=settings.parallel, ctx_per_slot=settings.ctx_per_slot, wired_limit_gb=wired_limit_gb,
        weights_gb=weights, headroom_gb=settings.headroom_gb, kv_bytes_per_token=kv_per_token,
        calibrated_cap=settings.calibrated_cap, n_ctx_train=n_ctx_train,
    )
    if chosen.chosen_by == "memory" and chosen.parallel > sizing.DEFAULT_SLOTS:
        chosen = replace(chosen, parallel=sizing.DEFAULT_SLOTS,
                         reason=f"{sizing.DEFAULT_SLOTS} slots x {chosen.ctx_per_slot} tokens: at most "
                                f"{sizing.DEFAULT_SLOTS} for one model of several ({chosen.fits} would "
                                "fit alone; --parallel to choose)")
    refusal = None
    if wired_limit_gb is not None and kv_per_token:
        refusal = sizing.cannot_hold(chosen, weights, settings.headroom_gb, wired_limit_gb, kv_per_token)
    memory = None
    if weights is not None and kv_per_token is not None:
        memory = weights + chosen.parallel * kv_per_token * chosen.ctx_per_slot / GB
    return ModelSpec(name, path, chosen, memory), refusal


PRESET_DIR_PREFIX = "macpool-models-"


def preset_dir() -> tempfile.TemporaryDirectory[str]:
    """A temporary folder for this agent's preset file, named after its process. An agent killed with -9
    cannot remove its own: the folders of agents no longer running are removed here first."""
    for old in Path(tempfile.gettempdir()).glob(PRESET_DIR_PREFIX + "*-*"):
        pid = old.name.removeprefix(PRESET_DIR_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{PRESET_DIR_PREFIX}{os.getpid()}-")


def write_preset(path: Path, specs: Iterable[ModelSpec]) -> None:
    """llama-server's ``--models-preset`` file: one section per model (its id), with its file and slots."""
    lines = ["version = 1", ""]
    for spec in specs:
        total_ctx = spec.sizing.parallel * spec.sizing.ctx_per_slot
        lines += [f"[{spec.name}]", f"model = {spec.path.resolve()}", f"parallel = {spec.sizing.parallel}",
                  f"ctx-size = {total_ctx}", ""]
    path.write_text("\n".join(lines))


@dataclass(eq=False)
class Unit:
    """One model as a pool node: its settings (node id and URL), its runtime, and whether it holds memory."""

    spec: ModelSpec
    settings: AgentSettings
    runtime: Runtime
    held: bool = False  # loaded, loading, or not yet unloaded: its memory counts against the budget
    loading: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def memory_gb(self) -> float:
        return self.spec.memory_gb or 0.0

    @property
    def evictable(self) -> bool:
        """Loaded, done loading, and no request in flight: unloading it loses nothing."""
        busy = self.loading is not None and not self.loading.done()
        return self.held and not busy and self.runtime.in_flight == 0 and not self.runtime.draining


@dataclass
class Budget:
    """The Mac's memory for models: ``limit_gb`` (wired limit - headroom; None: not known, no bound)."""

    limit_gb: float | None

    def plan(self, want: Unit, units: Iterable[Unit]) -> list[Unit] | None:
        """The idle models to unload (least recently used first) so that ``want`` fits; [] when it fits
        now; None when it does not fit even with every idle model unloaded."""
        if self.limit_gb is None:
            return []
        held = [u for u in units if u is not want and u.held]
        free = self.limit_gb - sum(u.memory_gb for u in held)
        victims: list[Unit] = []
        for unit in sorted((u for u in held if u.evictable), key=lambda u: u.runtime.last_busy):
            if want.memory_gb <= free + 1e-9:
                break
            victims.append(unit)
            free += unit.memory_gb
        return victims if want.memory_gb <= free + 1e-9 else None

    def cost(self, want: Unit, units: Iterable[Unit]) -> LoadCost:
        victims = self.plan(want, units)
        return "full" if victims is None else "evict" if victims else "free"


@dataclass
class ModelHost:
    """Loads and unloads the models of one Mac through llama-server's router mode, within the budget."""

    settings: AgentSettings
    runtime: Runtime  # the agent's own: the HTTP client, and the router-mode llama-server's URL
    store: ElasticStore
    budget: Budget
    units: dict[str, Unit] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load decision at a time
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    relieved_at: float = float("-inf")  # when memory pressure last unloaded a model

    def add(self, spec: ModelSpec, node_settings: AgentSettings) -> Unit:
        runtime = Runtime(node_settings)
        runtime.sizing = spec.sizing
        runtime.http, runtime.upstream_transport = self.runtime.http, self.runtime.upstream_transport
        runtime.upstream_url = self.runtime.upstream_url
        runtime.model = spec.name
        runtime.details["model"] = {"path": str(spec.path), "memory_gb": spec.memory_gb}
        runtime.details["sizing"] = spec.sizing.as_dict()
        unit = self.units[spec.name] = Unit(spec, node_settings, runtime)
        return unit

    def standby_for(self, unit: Unit) -> Standby:
        return Standby(unit.runtime, self.store, lambda: self.start_load(unit), lambda: self.unload(unit))

    def load_cost(self, unit: Unit) -> LoadCost:
        return self.budget.cost(unit, self.units.values())

    def set_upstream(self, url: str) -> None:
        self.runtime.upstream_url = url
        for unit in self.units.values():
            unit.runtime.upstream_url = url

    # --- load and unload --------------------------------------------------------------------------------
    def start_load(self, unit: Unit) -> None:
        if unit.loading is not None and not unit.loading.done():
            return
        unit.loading = self._spawn(self._load(unit), f"load {unit.name}")

    def _spawn(self, work: Coroutine[object, object, None], name: str) -> asyncio.Task[None]:
        """A load or an unload in the background, kept until it ends (``close`` cancels what is left)."""
        task = asyncio.create_task(work, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _load(self, unit: Unit) -> None:
        async with self.lock:
            victims = self.budget.plan(unit, self.units.values())
            if victims is None:
                await self._refuse(unit)
                return
            for victim in victims:  # (no await since the plan: none of them has taken a request since)
                victim.runtime.begin_standby_drain()
            unit.held = True
            for victim in victims:
                log.info("unloading idle model %s to make room for %s (%.2f GB)", victim.name, unit.name,
                         unit.memory_gb)
                await self._evict(victim)
        started = time.monotonic()
        problem = await self._ask_load(unit)
        if problem:
            log.warning("model %s did not load: %s; back to standby", unit.name, problem)
            unit.held = False
            unit.runtime.enter_standby()
            await self._say_standby(unit)
            return
        load_s = time.monotonic() - started
        log.info("model %s loaded in %.1fs", unit.name, load_s)
        unit.runtime.llama_up(load_s)
        unit.runtime.beat_now.set()

    async def _evict(self, victim: Unit) -> None:
        """Unload an idle model already admitting nothing (``begin_standby_drain``), and say in Redis that
        it is in standby, so that no router's earlier word loads it again."""
        await self._say_standby(victim)
        await self.unload(victim)
        victim.runtime.enter_standby()

    def relieve_pressure(self, beats: int) -> None:
        """Memory pressure for ``beats`` heartbeats on a loaded model's node (every loaded model sees the
        Mac's): unload the least recently used idle model, at most one per ``beats`` heartbeats."""
        now = time.monotonic()
        if now < self.relieved_at + beats * self.settings.heartbeat_interval:
            return
        self.relieved_at = now
        idle = sorted((u for u in self.units.values() if u.evictable), key=lambda u: u.runtime.last_busy)
        if not idle:
            log.warning("memory pressure for %d heartbeats and every loaded model is busy: nothing idle to "
                        "unload", beats)
            return
        victim = idle[0]
        log.warning("memory pressure for %d heartbeats: unloading the idle model %s (%.2f GB)", beats,
                    victim.name, victim.memory_gb)
        victim.runtime.begin_standby_drain()
        self._spawn(self._evict(victim), f"unload {victim.name}")

    async def _refuse(self, unit: Unit) -> None:
        held = ", ".join(f"{u.name} ({u.memory_gb:.2f} GB, {u.runtime.in_flight} in flight)"
                         for u in self.units.values() if u.held)
        log.warning("model %s (%.2f GB) does not fit the memory budget (%.2f GB) beside the busy models %s: "
                    "not loading it now", unit.name, unit.memory_gb, self.budget.limit_gb or 0.0, held)
        unit.runtime.enter_standby()
        await self._say_standby(unit)

    async def _ask_load(self, unit: Unit) -> str:
        """POST /models/load, then wait for /models to call it loaded; "" when it is, else what went wrong."""
        client = self.runtime.client()
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        asked = False
        while time.monotonic() < deadline:
            try:
                if not asked:
                    response = await client.post(self.runtime.upstream_url + "/models/load",
                                                 json={"model": unit.name}, timeout=10.0)
                    asked = response.status_code == 200 or b"already running" in response.content
                    if not asked and response.status_code != 503:
                        return f"llama-server answered the load with HTTP {response.status_code}: " \
                               f"{response.text[:200]}"
                else:
                    status = await self._listed(unit)
                    if status == "loaded":
                        return ""
                    if status in ("unloaded", None):
                        return f"llama-server lists it as {status or 'unknown'} (its load failed)"
            except (httpx.HTTPError, ValueError):
                pass  # llama-server is (re)starting: wait for it, within the timeout
            await asyncio.sleep(LOAD_POLL_S)
        return f"not loaded within {LOAD_TIMEOUT_S:.0f}s"

    async def unload(self, unit: Unit) -> None:
        """Unload ``unit``'s model and wait until its process has exited (nothing when llama-server runs it
        no more). llama-server answers ``/models/unload`` at once and lists the model as loaded until the
        process is gone: counting its memory free before then would overcommit, and loading it again then
        would find the old process (``already running``) about to exit under the next request."""
        deadline = time.monotonic() + UNLOAD_TIMEOUT_S
        with contextlib.suppress(httpx.HTTPError):  # (whether it went through, /models says below)
            await self.runtime.client().post(self.runtime.upstream_url + "/models/unload",
                                             json={"model": unit.name}, timeout=30.0)
        while time.monotonic() < deadline:
            try:
                if await self._listed(unit) in ("unloaded", None):
                    break
            except httpx.ConnectError:
                break  # llama-server is down (being restarted): the model's process went with it
            except (httpx.HTTPError, ValueError):
                pass  # slow to answer: ask again, within the deadline
            await asyncio.sleep(LOAD_POLL_S)
        else:
            log.warning("model %s still listed as running %.0fs after its unload", unit.name,
                        UNLOAD_TIMEOUT_S)
        unit.held = False
        log.info("model %s unloaded", unit.name)

    async def reload(self) -> None:
        """Have llama-server read its preset file again (models added or removed), keeping what runs."""
        try:
            await self.runtime.client().get(self.runtime.upstream_url + "/models", params={"reload": "1"},
                                            timeout=30.0)
        except httpx.HTTPError as exc:  # (down: a restarted llama-server reads the file anyway)
            log.warning("llama-server did not reread its models (%s); it does at its next start",
                        type(exc).__name__)

    async def _listed(self, unit: Unit) -> str | None:
        """``unit``'s status in llama-server's ``GET /models`` (httpx's errors, or ValueError, when it does
        not answer it)."""
        listing = await self.runtime.client().get(self.runtime.upstream_url + "/models", timeout=5.0)
        return model_status(listing.json(), unit.name)

    def llama_server_exited(self) -> None:
        """The router-mode llama-server exited (it is restarted): every model is unloaded with it. Those the
        pool still wants are loaded again once it answers (their desired word is still ``active``)."""
        for unit in self.units.values():
            unit.held = False
            unit.runtime.metrics.restarts.inc()
            unit.runtime.enter_standby()

    async def _say_standby(self, unit: Unit) -> None:
        """Write ``standby`` to the model's desired key, so that no earlier word loads it again."""
        try:
            await self.store.set_desired(unit.settings.node_id, "standby")
        except (RedisError, OSError) as exc:
            log.warning("could not tell the pool that %s is in standby: %s", unit.settings.node_id, exc)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def unit_settings(settings: AgentSettings, spec: ModelSpec) -> AgentSettings:
    """The settings a model's node runs with: its own node id, URL, file and slots; elastic, in standby."""
    return settings.model_copy(update={
        "node_id": f"{settings.node_id}/{spec.name}",
        "advertise_url": f"{settings.public_url}/m/{spec.name}",
        "model": str(spec.path),
        "models": {},
        "parallel": spec.sizing.parallel,
        "elastic": True,
        "standby": True,
    })
