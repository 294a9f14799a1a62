"""The agent's side of the pool's desired state (``--from-pool``): take the models the pool declares
(``macpool models add``) that fit this Mac, download them, serve them; give back those it no longer wants.

Every interval the agent reads the declared models. For one it does not hold, it resolves the reference
(its size, from the hub's metadata) and asks whether it fits: the model's weights within the Mac's memory
budget (the wired limit less the headroom: the one budget every model of the Mac shares,
node_agent/models.py) and its files on the disk. Then it claims a replica (macpool/store/models.py: atomic,
never more Macs than the replicas, and of the Macs wanting one the one holding fewest models takes it),
downloads the files into the Hugging Face cache - its node meanwhile in the pool as ``downloading``, with
how far - and, once they are verified, serves the model as one of ``--models``: a node of its own, in
standby, loaded on a router's demand. One download at a time. Its claim is a lease it renews each interval,
so a Mac that dies gives its replicas back by itself. A model removed (``macpool models rm``), or whose
reference changed, is drained - its node admits nothing new, its requests finish - unloaded and forgotten,
and the replica given back.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from redis.exceptions import RedisError

from macpool import __version__
from macpool.contract import DeclaredModel, Download, ModelState, NodeDoc, heartbeat_ttl_ms, now_ms
from macpool.loops import every
from macpool.store import Keys, Store
from macpool.store.connect import AnyRedis
from macpool.store.models import ModelStore

from . import hub
from .models import ModelSpec
from .settings import AgentSettings

log = logging.getLogger("macpool.agent")
T = TypeVar("T")

LEASE_INTERVALS = 10  # a claim lasts this many intervals unless renewed
SETTLE_INTERVALS = 2  # a Mac wants a replica this long before it takes it (the others say they want it too)


class ModelAgent(Protocol):
    """What the agent offers the pool's models (node_agent/agent.py)."""

    settings: AgentSettings

    @property
    def budget_gb(self) -> float | None: ...
    def hosts(self, name: str) -> bool: ...
    def plan(self, name: str, path: Path) -> tuple[ModelSpec, str | None]: ...
    async def add_model(self, spec: ModelSpec) -> None: ...
    async def remove_model(self, name: str) -> None: ...


@dataclass
class Held:
    """A declared model this Mac holds a replica of: downloading it, serving it, or giving it back."""

    model: DeclaredModel
    phase: str = "downloading"  # downloading, serving, removing
    progress: hub.Progress | None = None
    cancelled: bool = False
    task: asyncio.Task[None] | None = None
    started_ms: int = field(default_factory=now_ms)  # its node's, while it downloads


@dataclass
class PoolModels:
    settings: AgentSettings
    store: ModelStore
    redis: AnyRedis
    agent: ModelAgent
    held: dict[str, Held] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # model -> why not, as last logged
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.interval = max(self.settings.heartbeat_interval, 0.5)
        self.lease_ms = int(self.interval * LEASE_INTERVALS * 1000)
        self.settle_ms = int(self.interval * SETTLE_INTERVALS * 1000)
        self.node_store = Store(self.redis, Keys(self.settings.key_prefix))
        self.instance = secrets.token_hex(8)

    @property
    def agent_id(self) -> str:
        return self.settings.node_id

    async def run(self) -> None:
        try:
            await every(self.interval, self.step, "pool models", log, first_now=True)
        finally:
            for task in self.tasks:
                task.cancel()
            for held in self.held.values():
                held.cancelled = True
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def step(self) -> None:
        """One look at the declared models: give back, renew, take at most one new one."""
        declared = await self.store.declared()
        for name, held in list(self.held.items()):
            if held.phase == "removing":
                continue
            model = declared.get(name)
            if model is None or model.removing or model.ref != held.model.ref:
                self._give_back(name, "removed from the pool" if model is None or model.removing
                                else f"its reference is now {model.ref}")
                continue
            held.model = model
            status = await self.store.claim(name, self.agent_id, self.lease_ms, len(self.held),
                                            self.settle_ms)
            if status != "claimed":
                self._give_back(name, f"its replica is no longer this Mac's ({status})")
        if any(h.phase == "downloading" for h in self.held.values()):
            return
        for model in declared.values():
            if model.removing or model.name in self.held or self.agent.hosts(model.name):
                continue
            await self._consider(model)
            if model.name in self.held:
                return

    async def _consider(self, model: DeclaredModel) -> None:
        """Take a replica of ``model`` if it fits this Mac and the pool lets it."""
        source = hub.model_source(model.ref)
        try:
            if isinstance(source, hub.HubRef):
                ref = source
                resolved: hub.Resolved | None = await _in_thread(lambda: hub.resolve(ref))
                path = None
            else:
                resolved, path = None, source
                size = await asyncio.to_thread(_file_size, source)
        except hub.HubError as exc:
            self._refuse(model, str(exc))
            return
        if resolved is not None:
            size = resolved.size
        elif size < 0:
            self._refuse(model, f"{source}: no such file on this Mac, nor a Hugging Face reference")
            return
        why = self._no_room(size, resolved)
        if why:
            self._refuse(model, why)
            return
        status = await self.store.claim(model.name, self.agent_id, self.lease_ms, len(self.held),
                                        self.settle_ms)
        if status != "claimed":
            return
        self.refused.pop(model.name, None)
        held = self.held[model.name] = Held(model)
        log.info("model %s (%s, %.2f GB): this Mac takes a replica", model.name, model.ref, size / 1e9)
        held.task = self._spawn(self._fetch(held, resolved, path), f"fetch {model.name}")

    def _no_room(self, size: int, resolved: hub.Resolved | None) -> str:
        """Why this Mac cannot take a model of ``size`` bytes ("": it can): its weights alone must fit the
        memory budget with a request's working set beside them, and its files the disk."""
        budget = self.agent.budget_gb
        need = size / 1e9 + self.settings.request_overhead_gb
        if budget is not None and need > budget:
            return f"{size / 1e9:.2f} GB of weights do not fit this Mac's memory budget ({budget:.2f} GB)"
        if resolved is not None:
            from huggingface_hub import constants

            folder = Path(constants.HF_HUB_CACHE)
            while not folder.exists():
                folder = folder.parent
            free = shutil.disk_usage(folder).free
            if free < size:
                return f"{size / 1e9:.2f} GB do not fit the disk of {folder} ({free / 1e9:.2f} GB free)"
        return ""

    def _refuse(self, model: DeclaredModel, why: str) -> None:
        if self.refused.get(model.name) != why:
            log.info("model %s (%s): not on this Mac: %s", model.name, model.ref, why)
            self.refused[model.name] = why

    async def _fetch(self, held: Held, resolved: hub.Resolved | None, path: Path | None) -> None:
        """Download (its node says how far meanwhile), check, then serve; or give the replica back."""
        name = held.model.name
        if resolved is not None:
            held.progress = hub.Progress(name, resolved.size)
            beats = self._spawn(every(self.settings.heartbeat_interval, lambda: self._beat(held),
                                      f"download {name}", log, first_now=True), f"download beat {name}")
            try:
                path = await _in_thread(lambda: hub.download(resolved, held.progress, lambda: held.cancelled))
            except hub.HubError as exc:
                log.warning("model %s: %s; the replica goes back to the pool", name, exc)
                self.refused[name] = str(exc)
                await self._forget(held)
                return
            finally:
                beats.cancel()
        assert path is not None
        spec, refusal = self.agent.plan(name, path)
        if refusal is not None:
            self._refuse(held.model, refusal)
            await self._forget(held)
            return
        await self.agent.add_model(spec)
        held.phase = "serving"
        log.info("model %s: on this Mac, in standby (loaded on demand)", name)

    async def _beat(self, held: Held) -> None:
        """The node of a model downloading: in the pool, admitting nothing, saying how far it is."""
        progress = held.progress
        assert progress is not None
        name, settings = held.model.name, self.settings
        download = Download(done_bytes=progress.done, total_bytes=progress.total)
        doc = NodeDoc(
            node_id=f"{settings.node_id}/{name}", url=f"{settings.public_url}/m/{name}", models=[name],
            state="downloading", elastic=True, agent_version=__version__, instance=self.instance,
            reason=f"downloading {held.model.ref}: {download.percent:.0f}% of {progress.total / 1e9:.2f} GB",
            started_at_ms=held.started_ms, updated_at_ms=now_ms(),
            model_states=[ModelState(name=name, state="downloading", download=download)],
        )
        credential = settings.credential()  # signed as the Mac's other nodes are, when the pool issued one
        if credential is not None:
            doc = credential.sign(doc)
        await self.node_store.heartbeat(doc, heartbeat_ttl_ms(settings.heartbeat_interval))

    def _give_back(self, name: str, why: str) -> None:
        held = self.held[name]
        log.info("model %s: %s: draining it, then unloading it", name, why)
        held.cancelled = True
        if held.task is not None:
            held.task.cancel()
        phase, held.phase = held.phase, "removing"
        self._spawn(self._remove(held, serving=phase == "serving"), f"remove {name}")

    async def _remove(self, held: Held, serving: bool) -> None:
        name = held.model.name
        if serving or self.agent.hosts(name):
            await self.agent.remove_model(name)
        log.info("model %s: removed from this Mac", name)
        await self._forget(held)

    async def _forget(self, held: Held) -> None:
        """Leave the pool's node of a model not served here, and give its replica back."""
        name = held.model.name
        self.held.pop(name, None)
        try:
            if not self.agent.hosts(name):
                await self.node_store.deregister(f"{self.settings.node_id}/{name}", self.instance)
            if await self.store.release(name, self.agent_id):
                log.info("model %s: the last replica given back: the pool forgets it", name)
        except (RedisError, OSError) as exc:  # the lease lapses by itself
            log.warning("model %s: could not give the replica back (%s); it lapses with its lease", name, exc)

    def _spawn(self, work: object, name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.create_task(work, name=name)  # type: ignore[arg-type]
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed", task.get_name(), exc_info=task.exception())


def _file_size(path: Path) -> int:
    """A GGUF's size in bytes; -1 when there is no such file."""
    return path.stat().st_size if path.is_file() else -1


async def _in_thread(work: Callable[[], T]) -> T:
    """``work()`` in a daemon thread: a download the agent's shutdown does not wait for (asyncio's own
    executor would hold the exit until the file is done)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="model download", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[T], result: T | None, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)  # type: ignore[arg-type]
