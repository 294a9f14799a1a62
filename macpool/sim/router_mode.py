"""llama-server's router mode, simulated: one Mac serving several models, loaded and unloaded on demand.

A real ``llama-server --models-dir DIR`` lists the models it can serve on ``GET /models``, starts a child
llama-server per model on ``POST /models/load`` (or on a request naming an unloaded model, with autoload),
stops it on ``POST /models/unload``, and relays each request to the child that serves the model its body (or
its ``?model=`` query) names; ``--models-max`` bounds how many run at once, evicting the least recently used
idle one. Shapes and error texts are those of tools/server/server-models.cpp, and tests/contract checks them
against the real server.

Here each child is a :class:`~macpool.sim.app.SimServer` in this process, with the model's own figures
(weights, KV per token, speed: :mod:`macpool.sim.router_models`) on this Mac's memory (the
``--preset``/``--machine`` of the router), and its own slots and context: the memory every loaded model
holds is counted against the one wired limit (each child sees the others as external memory), so a Mac
that loads too much pages, or fails the load (``overcommit: fail``). Loading takes
``0.5 s + weights / load_gb_s`` of simulated time. ``POST /models/unload`` answers at once and the model
stays listed as loaded until its child has exited (``CHILD_EXIT_S`` later), as a real child's graceful exit
does; a model still loading is stopped at once (the real router kills it). Unloading a model with requests
in flight cuts them, as the child's exit does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from macpool.apis import APIS
from macpool.sim import shapes
from macpool.sim.app import LlamaHeaders, SimServer, http_error, json_response, parse_error, server_error
from macpool.sim.machine import Machine, MachineError
from macpool.sim.router_models import SimModel, router_models
from macpool.sim.settings import SimSettings, build_info

LOAD_FIXED_S = 0.5  # process start and context creation, on top of reading the weights
CHILD_EXIT_S = 0.3  # from the router's exit command to the child's exit, its memory given back
Handler = Callable[[Request], Awaitable[Response]]
MEMORY_SYNC_S = 0.1  # how often each child's view of the other models' memory is brought up to date


def error(code: int, message: str, kind: str = "invalid_request_error") -> Response:
    return json_response(shapes.error(code, message, kind), code)


class ModelUnloaded(RuntimeError):
    """The model's child stopped under a request (an unload): its connection is cut."""


@dataclass(eq=False)
class Hosted:
    """One model this Mac can serve, and its child while it runs."""

    spec: SimModel
    status: str = "unloaded"  # unloaded, loading, loaded
    exit_code: int = 0
    server: SimServer | None = None
    app: ASGIApp | None = None
    runner: asyncio.Task[None] | None = None
    loading: asyncio.Task[None] | None = None
    exiting: asyncio.Task[None] | None = None  # the child's exit under way, after an unload
    last_used: float = 0.0
    loads: int = 0  # loads begun (the simulator's own count, for tests and benches)
    active: set[asyncio.Task[None]] = field(default_factory=set)  # requests being served by the child

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def machine(self) -> Machine:
        return self.spec.machine

    def pinned_gb(self) -> float:
        """What the child holds now (its own share: the other models are not counted)."""
        if self.server is None:
            return 0.0
        engine = self.server.engine
        return engine.pinned_gb() - engine.external_gb


class SimRouter:
    """The router-mode simulator: the models, their children, and the HTTP surface."""

    def __init__(self, settings: SimSettings, mac: Machine, models: Sequence[SimModel]) -> None:
        self.settings = settings
        self.mac = mac
        self.hosted = {spec.name: Hosted(spec) for spec in models}
        if len(self.hosted) < len(models):
            raise MachineError("the router's models must have different names")
        self.external_gb = 0.0  # other software's memory (/sim/pressure)
        self.created = int(time.time())

    # --- lifecycle ----------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        sync = asyncio.create_task(self._sync_memory(), name="sim-router-memory")
        try:
            yield
        finally:
            sync.cancel()
            for hosted in self.hosted.values():
                if hosted.exiting is not None:
                    hosted.exiting.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await hosted.exiting
                await self._stop(hosted)
            with contextlib.suppress(asyncio.CancelledError):
                await sync

    async def _sync_memory(self) -> None:
        while True:
            self.share_memory()
            await asyncio.sleep(MEMORY_SYNC_S)

    def share_memory(self) -> None:
        """Each child counts the other models (and other software) as memory it does not hold."""
        held = {name: h.pinned_gb() for name, h in self.hosted.items()}
        total = sum(held.values())
        for name, hosted in self.hosted.items():
            if hosted.server is not None:
                hosted.server.engine.external_gb = total - held[name] + self.external_gb

    def pinned_gb(self) -> float:
        return sum(h.pinned_gb() for h in self.hosted.values()) + self.external_gb

    # --- loading ------------------------------------------------------------------------------------------
    def load_seconds(self, hosted: Hosted) -> float:
        """Simulated seconds to load ``hosted``: the settings' --load-seconds, else from its weights."""
        if self.settings.load_seconds:
            return self.settings.load_seconds
        return LOAD_FIXED_S + hosted.machine.weights_gb / self.mac.load_gb_s

    def start_load(self, hosted: Hosted) -> None:
        """Begin loading ``hosted`` (its status is ``loading`` until the child serves, or failed)."""
        hosted.status, hosted.exit_code = "loading", 0
        hosted.loads += 1
        hosted.last_used = time.monotonic()
        hosted.loading = asyncio.create_task(self._load(hosted), name=f"sim-load-{hosted.name}")

    async def _load(self, hosted: Hosted) -> None:
        await asyncio.sleep(self.load_seconds(hosted) / self.settings.speed)
        spec = hosted.spec
        settings = self.settings.model_copy(update={
            "model": spec.model or spec.name, "alias": spec.name, "parallel": spec.parallel,
            "ctx_size": spec.ctx_size, "load_seconds": 0, "models": None, "models_preset": None,
        })
        try:
            server = SimServer(settings, hosted.machine)
        except MachineError:
            hosted.status, hosted.exit_code = "unloaded", 1
            return
        others = self.pinned_gb()
        need = server.engine.pinned_gb() + others
        if hosted.machine.overcommit == "fail" and need > self.mac.wired_limit_gb:
            hosted.status, hosted.exit_code = "unloaded", 1  # the child could not allocate its buffers
            return
        server.engine.external_gb = others
        hosted.server, hosted.app = server, server_app(server)
        hosted.runner = asyncio.create_task(server.runner.run(), name=f"sim-engine-{hosted.name}")
        hosted.status = "loaded"
        self.share_memory()

    async def ready(self, hosted: Hosted) -> bool:
        """Wait for a load under way; whether the model serves."""
        loading = hosted.loading
        if loading is not None:
            await asyncio.wait([loading])  # (an unload may cancel it: then the model does not serve)
        return hosted.status == "loaded"

    def evict_for(self, hosted: Hosted) -> str | None:
        """Make room under --models-max by unloading the least recently used idle model; an error message
        when every running model is busy."""
        limit = self.settings.models_max
        running = [h for h in self.hosted.values() if h.status != "unloaded" and h is not hosted]
        if limit <= 0 or len(running) < limit:
            return None
        idle = [h for h in running if h.status == "loaded" and not h.active]
        if not idle:
            return "model limit reached, try again later"
        victim = min(idle, key=lambda h: h.last_used)
        asyncio.get_running_loop().create_task(self._stop(victim))
        victim.status = "unloaded"
        return None

    async def _stop(self, hosted: Hosted) -> None:
        """Stop the child: its requests in flight are cut, its memory is given back."""
        hosted.status = "unloaded"
        for task in [hosted.loading, *hosted.active, hosted.runner]:
            if task is not None and not task.done():
                task.cancel()
        for task in [hosted.loading, *hosted.active, hosted.runner]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        hosted.server = hosted.app = hosted.runner = hosted.loading = None
        hosted.active.clear()
        self.share_memory()

    # --- routes -------------------------------------------------------------------------------------------
    def routes(self) -> list[Route]:
        by_body, by_query = ModelProxy(self, from_body=True), ModelProxy(self, from_body=False)
        props = ModelProxy(self, from_body=False, without_model=self.props)
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/models/load", self.load, methods=["POST"]),
            Route("/models/unload", self.unload, methods=["POST"]),
            Route("/props", props, methods=["GET"]),
            Route("/slots", by_query, methods=["GET"]),
            Route("/metrics", by_query, methods=["GET"]),
            *(Route(path, by_body, methods=["POST"]) for path in APIS),  # every API, to the model it names
            Route("/sim/memory", ModelProxy(self, from_body=False, without_model=self.sim_memory),
                  methods=["GET"]),
            Route("/sim/stats", by_query, methods=["GET"]),
            Route("/sim/pressure", self.sim_pressure, methods=["POST"]),
        ]

    async def health(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return json_response({"data": [self.model_json(h) for h in self.hosted.values()], "object": "list"})

    def model_json(self, hosted: Hosted) -> dict[str, Any]:
        status: dict[str, Any] = {"value": hosted.status, "args": self.child_args(hosted)}
        if hosted.status == "unloaded" and hosted.exit_code != 0:
            status.update(exit_code=hosted.exit_code, failed=True)
        out: dict[str, Any] = {
            "id": hosted.name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
            "created": self.created, "status": status,
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": "models_dir", "can_remove": False,
        }
        if hosted.server is not None and hosted.status == "loaded":
            out["meta"] = hosted.server.model_meta()
        return out

    def child_args(self, hosted: Hosted) -> list[str]:
        spec = hosted.spec
        args = ["llama-server", "--host", "127.0.0.1", "--port", "0", "--alias", spec.name]
        if spec.ctx_size:
            args += ["--ctx-size", str(spec.ctx_size)]
        args += ["--model", spec.model or spec.name]
        if spec.parallel:
            args += ["--parallel", str(spec.parallel)]
        return args

    async def _named(self, request: Request) -> Hosted | Response:
        """The model a load or unload names, or the error to answer."""
        parsed = await _json_body(request)
        if isinstance(parsed, Response):
            return parsed
        name = parsed.get("model") if isinstance(parsed, dict) else None
        hosted = self.hosted.get(name) if isinstance(name, str) else None
        return hosted if hosted is not None else error(400, "model is not found")

    async def load(self, request: Request) -> Response:
        hosted = await self._named(request)
        if isinstance(hosted, Response):
            if hosted.status_code == 400 and b"not found" in hosted.body:
                return json_response(shapes.error_mtc(404, "File Not Found", "not_found_error"), 404)
            return hosted
        if hosted.status != "unloaded":
            return error(400, "model is already running")
        refused = self.evict_for(hosted)
        if refused:
            return error(500, refused, "server_error")
        self.start_load(hosted)
        return json_response({"success": True})

    async def unload(self, request: Request) -> Response:
        hosted = await self._named(request)
        if isinstance(hosted, Response):
            return hosted
        if hosted.status == "unloaded":
            return error(400, "model is not running")
        if hosted.status == "loading":
            await self._stop(hosted)
        elif hosted.exiting is None:
            hosted.exiting = asyncio.create_task(self._exit(hosted), name=f"sim-exit-{hosted.name}")
        return json_response({"success": True})

    async def _exit(self, hosted: Hosted) -> None:
        """The child's graceful exit: listed as loaded until it is gone."""
        try:
            await asyncio.sleep(CHILD_EXIT_S)
            await self._stop(hosted)
        finally:
            hosted.exiting = None

    async def props(self, request: Request) -> Response:
        s = self.settings
        return json_response({
            "role": "router", "max_instances": s.models_max, "models_autoload": s.models_autoload,
            "model_alias": "llama-server", "model_path": "none",
            "default_generation_settings": {"params": None, "n_ctx": 0},
            "ui_settings": {}, "build_info": build_info(), "cors_proxy_enabled": False,
        })

    async def sim_memory(self, request: Request) -> Response:
        mac = self.mac
        pinned = self.pinned_gb()
        state = mac.state(pinned)
        return json_response({
            "total_gb": mac.total_gb,
            "wired_limit_gb": mac.wired_limit_gb,
            "pinned_gb": round(pinned, 3),
            "state": state.value,
            "external_gb": self.external_gb,
            "swap_used_gb": round(max(0.0, pinned - mac.wired_limit_gb), 3),
            "models": {name: {"status": h.status, "pinned_gb": round(h.pinned_gb(), 3), "loads": h.loads}
                       for name, h in self.hosted.items()},
        })

    async def sim_pressure(self, request: Request) -> Response:
        try:
            value = json.loads(await request.body() or b"{}").get("external_gb")
        except (json.JSONDecodeError, AttributeError):
            value = None
        if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
            return error(400, "'external_gb' must be a number >= 0")
        self.external_gb = float(value)
        self.share_memory()
        return await self.sim_memory(request)


class ModelProxy:
    """An ASGI endpoint relaying a request to the child serving the model its body (``from_body``) or its
    ``?model=`` query names, loading it first with autoload. ``without_model`` answers a query naming none
    (the router's own /props)."""

    def __init__(self, router: SimRouter, from_body: bool, without_model: Handler | None = None) -> None:
        self.router = router
        self.from_body = from_body
        self.without_model = without_model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        chosen = await self.choose(request)
        if isinstance(chosen, Response):
            await chosen(scope, receive, send)
            return
        hosted, body = chosen
        await self.relay(hosted, scope, body, receive, send)

    async def choose(self, request: Request) -> Response | tuple[Hosted, bytes]:
        """The model's child, ready, and the body read to find it; or the error to answer."""
        router = self.router
        body = b""
        if self.from_body:
            body = await request.body()
            parsed = await _json_body(request)
            if isinstance(parsed, Response):
                return parsed
            name = parsed.get("model") if isinstance(parsed, dict) else None
        else:
            name = request.query_params.get("model")
            if not name and self.without_model is not None:
                return await self.without_model(request)
        if not isinstance(name, str) or not name:
            return error(400, "model name is missing from the request")
        hosted = router.hosted.get(name)
        if hosted is None:
            return error(400, f"model '{name}' not found")
        if hosted.status == "unloaded":
            if not _autoload(router.settings.models_autoload, request.query_params.get("autoload")):
                return error(400, "model is not loaded")
            refused = router.evict_for(hosted)
            if refused:
                return error(500, refused, "server_error")
            router.start_load(hosted)
        if not await router.ready(hosted):
            return error(500, f"model {name} failed to load", "server_error")
        return hosted, body

    async def relay(self, hosted: Hosted, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """Serve the request on the child's app; an unload meanwhile cuts it (ModelUnloaded)."""
        app = hosted.app
        assert app is not None
        hosted.last_used = time.monotonic()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if self.from_body and not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def serve() -> None:
            await app(scope, replay, send)

        inner = asyncio.create_task(serve(), name=f"sim-request-{hosted.name}")
        hosted.active.add(inner)
        try:
            await asyncio.shield(inner)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                inner.cancel()
                raise
            raise ModelUnloaded(f"model {hosted.name} was unloaded") from None
        finally:
            hosted.active.discard(inner)
            hosted.last_used = time.monotonic()


async def _json_body(request: Request) -> Any:
    """The parsed body, or llama-server's 400 for one that is not JSON."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        return json_response(parse_error(raw, exc), 400)
    except UnicodeDecodeError:
        return error(400, "invalid UTF-8 in the body")


def _autoload(default: bool, param: str | None) -> bool:
    if not param:
        return default
    return param in ("true", "1")


def server_app(server: SimServer) -> ASGIApp:
    """A child's HTTP surface (the single-model simulator's routes), without its own lifespan."""
    handlers = {HTTPException: http_error, Exception: server_error}
    return Starlette(routes=server.routes(), exception_handlers=handlers)


def create_router_app(
    settings: SimSettings, mac: Machine | None = None, models: Sequence[SimModel] | None = None
) -> ASGIApp:
    """The router-mode simulator for ``settings`` on one Mac (``mac``, else the settings'), serving
    ``models``, else those of ``--models`` or ``--models-preset``."""
    mac = mac or settings.load_machine()
    router = SimRouter(settings, mac, router_models(settings, mac) if models is None else models)
    app = Starlette(routes=router.routes(), lifespan=router.lifespan,
                    exception_handlers={HTTPException: http_error, Exception: server_error})
    return LlamaHeaders(app)

