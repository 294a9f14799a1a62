"""The router's ASGI application: ``create_app(settings)``."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp

from macpool.apis import APIS
from macpool.asgi import BodyTooLarge, ShutdownAnswering, TrailingSlash, UpgradeWithBody, read_body
from macpool.contract import Priority
from macpool.errors import error_response, exception_handlers
from macpool.settings import origin_list
from macpool.store import ANONYMOUS, Keys, Store
from macpool.store.connect import AnyRedis, Connection, connect
from macpool.store.events import drain_message
from macpool.upstream import Upstream, client_tls
from router import tokens
from router.admission import Admission, Ticket
from router.affinity import MIN_PREFIX_BYTES, prefix_hashes, session_digest
from router.aliases import Aliases
from router.auth import PRIORITIES, ApiKey, KeyRing, bearer_token, digest, load_api_keys, presented_key
from router.dialects import Dialect, api_of
from router.forward import Call, Forwarder, new_upstream
from router.liveness import Liveness
from router.metrics import RouterMetrics
from router.origins import OriginGuard
from router.pool import PoolView
from router.scale import ScaleConfig, ScaleWatch
from router.settings import Settings

log = logging.getLogger("macpool.router")


class BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class Services:
    """What the lifespan opens and the handlers use."""

    redis: AnyRedis
    client: Upstream  # to the agents
    pool: PoolView
    admission: Admission
    forwarder: Forwarder


class Router:
    """Request handlers over the shared services; the services exist between startup and shutdown."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.metrics = RouterMetrics()
        self.api_keys = KeyRing(load_api_keys(settings.api_keys_file) if settings.api_keys_file else [])
        self.admin_key = KeyRing([ApiKey(digest(settings.admin_key), "admin")] if settings.admin_key else [])
        # who may read the pool's figures (docs/security.md): the read key, or the admin key
        read = [ApiKey(digest(settings.read_key), "read")] if settings.read_key else []
        self.viewers = KeyRing(read + self.admin_key.keys) if settings.observability_guarded else None
        self.aliases = Aliases(settings.model_aliases)
        self._services: Services | None = None
        self.stopping = False  # set by the server's signal handler (router/cli.py): a shutdown has begun
        # the dashboard's history and the scale hint (and its webhook), sampled while the app runs
        self.scale = ScaleWatch(self.pool_json, ScaleConfig.from_settings(settings))

    @property
    def services(self) -> Services:
        if self._services is None:
            raise RuntimeError("the router is not started")
        return self._services

    # --- lifecycle ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        connection = redis_connection(self.settings)
        redis = connection.client
        settings = self.settings
        client = new_upstream(client_tls(settings.node_ca, settings.node_cert, settings.node_key))
        tenants = [key.tenant for key in self.api_keys.keys] or [ANONYMOUS]
        store = Store(redis, self.keys)
        pool = PoolView(self.settings, store, tenants)
        admission = Admission(self.settings, store, pool, self.metrics)
        forwarder = Forwarder(self.settings, client, pool, admission, self.metrics)
        liveness = Liveness(self.settings)
        try:
            await pool.start()
            await asyncio.to_thread(liveness.start)
            admission.start()
            self._services = Services(redis, client, pool, admission, forwarder)
            redis_at = connection.target.redacted
            log.info("router %s serving; redis %s", self.settings.router_id, redis_at)
            async with self.scale.running():
                yield
        finally:
            self._services = None
            # requests the server cancelled at its shutdown timeout are still giving their slots back
            await admission.settle(SETTLE_S)
            await admission.stop()
            await asyncio.to_thread(liveness.stop)
            await pool.stop()
            await client.aclose()
            await connection.aclose()

    def begin_shutdown(self) -> None:
        """The server got SIGTERM/SIGINT (called from its signal handler: only sets a flag)."""
        self.stopping = True

    def pool_json(self) -> dict[str, Any]:
        """The /api/pool document (also what the dashboard streams)."""
        services = self.services
        return services.pool.to_json() | services.admission.summary()

    # --- proxied endpoints -------------------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        arrived = time.monotonic()
        headers = request.headers
        path: str = request.scope["path"]
        api, dialect = api_of(path)
        key = self.api_keys.match(presented_key(headers))
        if self.api_keys.enabled and key is None:
            self.metrics.requests.labels(model="", node="", status="401").inc()
            return dialect.error(401, "invalid or missing API key", "invalid_api_key")
        try:
            _json_content(headers.get("content-type"))
            priority = self._priority(headers.get("x-macpool-priority"), key)
            body = await self._body(request)
            call = self._call(path, dialect, headers.raw, body, key, priority, arrived,
                              headers.get("x-request-id"), affinity=self.settings.affinity and not api.light,
                              light=api.light)
        except BadRequest as exc:
            self.metrics.requests.labels(model="", node="", status=str(exc.status)).inc()
            # a body refused before its end, or lost to an upgrade offer, leaves bytes unread: the connection
            # ends with the answer
            unread = exc.code in ("request_timeout", "upgrade_not_supported", "unsupported_media_type")
            close = {"Connection": "close"} if unread else None
            return dialect.error(exc.status, str(exc), exc.code, headers=close)
        except ClientDisconnect:
            return Response(status_code=400)
        call.query = request.scope["query_string"]
        return await self.services.forwarder.handle(call, request.receive, light=api.light)

    async def _body(self, request: Request) -> bytes:
        """The request's body, bounded in size (413) and in the time the client takes to send it (408)."""
        settings = self.settings
        try:
            async with asyncio.timeout(settings.request_read_timeout):
                return await read_body(request, settings.max_body_bytes)
        except BodyTooLarge as exc:
            raise BadRequest(413, str(exc), "request_too_large") from None
        except UpgradeWithBody as exc:
            raise BadRequest(400, str(exc), "upgrade_not_supported") from None
        except TimeoutError:
            message = f"the request body was not received within {settings.request_read_timeout:g} s"
            raise BadRequest(408, message, "request_timeout") from None

    def _call(
        self,
        path: str,
        dialect: Dialect,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        key: ApiKey | None,
        priority: Priority,
        arrived: float,
        request_id: str | None,
        affinity: bool,
        light: bool,
    ) -> Call:
        """The checked request (BadRequest when its body is not one the router can route)."""
        payload, asked = _inspect(body, self.settings.default_model)
        model = self.aliases.resolve(asked)
        if model != asked:  # the node gets the served name (several models on one Mac are told apart by it)
            payload["model"] = model
            body = json.dumps(payload).encode()
        # a body shorter than the shortest prefix worth steering for holds none: nothing to hash
        hashed = affinity and len(body) >= MIN_PREFIX_BYTES
        limit = key.max_concurrency if key and key.max_concurrency else self.settings.key_max_concurrency
        counted = dialect.in_context and not light
        session = dialect.session(Headers(raw=headers), payload) if not light else ""
        prefixes, shares = prefix_hashes(dialect.prefix_parts(payload) if hashed else [], model,
                                          session if affinity else "")
        ticket = Ticket(
            tenant=key.tenant if key else ANONYMOUS,
            priority=priority,
            key_limit=limit,
            model=model,
            prefixes=prefixes,
            prefix_shares=shares,
            generations=dialect.generations(payload),
            prompt_tokens=tokens.bound(body) if counted else 0,
            output_tokens=dialect.output_limit(payload) if counted else 0,
        )
        return Call(
            path=path,
            body=body,
            model=model,
            stream=dialect.streamed(payload),
            headers=[(k.lower(), v) for k, v in headers],
            request_id=_usable_request_id(request_id) or uuid.uuid4().hex,
            arrived=arrived,
            ticket=ticket,
            dialect=dialect,
            count_body=dialect.count_body(payload, body) if counted and dialect.count_path else None,
            session=session_digest(session) if session else "",
        )

    def shutdown_answer(self, request: Request) -> Response:
        """A request cancelled by the server's shutdown timeout before its answer began (ShutdownAnswering):
        it reached no client yet, so it is a 503 to retry - elsewhere, behind a balancer."""
        self.metrics.requests.labels(model="", node="", status="router_shutdown").inc()
        headers = {"Retry-After": "1", "X-Macpool-Reason": "router_shutdown"}
        return error_response(503, "the router is shutting down; retry", "router_shutdown", headers=headers)

    def _priority(self, header: str | None, key: ApiKey | None) -> Priority:
        if header is None:
            return key.priority if key and key.priority else self.settings.default_priority
        value = header.strip().lower()
        if value not in PRIORITIES:
            raise BadRequest(400, "X-Macpool-Priority must be interactive or batch", "invalid_priority")
        if key and key.priority == "batch":
            return "batch"  # the header lowers a request's class, never raises it above its key's
        return cast(Priority, value)

    # --- read-only endpoints -----------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """Every model the pool serves, then each exact alias of one (``macpool.alias_of``)."""
        if not self.api_keys.accepts(presented_key(request.headers)):
            return error_response(401, "invalid or missing API key", "invalid_api_key")
        states = self.services.pool.model_states()
        data = [self._model(m, states[m]) for m in states]
        data += [self._model(name, states[model], alias_of=model)
                 for name, model in self.aliases.exact.items() if model in states]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One model (the OpenAI SDK's ``models.retrieve``): served by a ready node, else 404."""
        if not self.api_keys.accepts(presented_key(request.headers)):
            return error_response(401, "invalid or missing API key", "invalid_api_key")
        name: str = request.path_params["model"]
        served = self.aliases.resolve(name)
        state = self.services.pool.model_states().get(served)
        if state is None:
            return error_response(404, f"model {name!r} is not served by any node", "model_not_found")
        return JSONResponse(self._model(name, state, alias_of=served if served != name else None))

    def _model(self, name: str, state: dict[str, Any], alias_of: str | None = None) -> dict[str, Any]:
        """An OpenAI model object; ``macpool`` (which OpenAI clients ignore) says where it is loaded, and
        which model an alias names or which aliases name a model."""
        extra = {"alias_of": alias_of} if alias_of else {"aliases": self.aliases.of(name)}
        return {"id": name, "object": "model", "created": 0, "owned_by": "macpool",
                "macpool": {**state, **extra}}

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "router_id": self.settings.router_id})

    async def ready(self, request: Request) -> Response:
        services = self.services
        try:
            await services.redis.ping()
            redis_ok = True
        except Exception:
            redis_ok = False
        ready_nodes = sum(1 for doc in services.pool.fresh_nodes() if services.pool.is_ready(doc))
        body = {"status": "ready" if redis_ok and ready_nodes else "not_ready",
                "redis_ok": redis_ok, "nodes_ready": ready_nodes}
        return JSONResponse(body, status_code=200 if redis_ok and ready_nodes else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        refused = self.unviewable(request)
        if refused is not None:
            return refused
        self.services.pool.export(self.metrics)
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def api_pool(self, request: Request) -> Response:
        return self.unviewable(request) or JSONResponse(self.pool_json())

    def unviewable(self, request: Request) -> Response | None:
        """401 for a request for the pool's figures without the read or the admin key, where they need one;
        else None. The key comes as ``Authorization: Bearer``, or in the dashboard's cookie (an
        ``EventSource`` cannot send headers)."""
        if self.viewers is None:
            return None
        cookie = unquote(request.cookies.get(VIEW_COOKIE, ""))
        presented = bearer_token(request.headers.get("authorization")) or cookie
        if self.viewers.match(presented) is not None:
            return None
        if not self.viewers.enabled:
            message = "the pool's figures need a read key, and this router has none: set --read-key-file"
            return error_response(401, message, "read_disabled")
        return error_response(401, "invalid or missing read key (or admin key)", "invalid_read_key")

    # --- admin -------------------------------------------------------------------------------------

    async def drain(self, request: Request) -> Response:
        return await self._set_drained(request, drained=True)

    async def undrain(self, request: Request) -> Response:
        return await self._set_drained(request, drained=False)

    async def _set_drained(self, request: Request, drained: bool) -> Response:
        if not self.admin_key.enabled:
            message = "the admin API is disabled (no admin key configured)"
            return error_response(401, message, "admin_disabled")
        if not self.admin_key.accepts(bearer_token(request.headers.get("authorization"))):
            return error_response(401, "invalid or missing admin key", "invalid_admin_key")
        node_id = request.path_params["node_id"]
        services = self.services
        if drained and node_id not in services.pool.snapshot.nodes:
            return error_response(404, f"node {node_id!r} is not in the pool", "node_not_found")
        try:
            await services.pool.store.drain(node_id, drained)
        except (RedisError, OSError) as exc:  # the drain lives in Redis: without it, nothing was changed
            action = "drain" if drained else "undrain"
            log.warning("%s of node %s failed: redis unreachable (%s: %s)", action, node_id,
                        type(exc).__name__, exc, extra={"node": node_id})
            message = f"Redis is unreachable: node {node_id!r} was not {action}ed; retry"
            return error_response(503, message, "pool_unavailable", headers={"Retry-After": "1"})
        services.pool.apply(drain_message(node_id, drained))
        return JSONResponse({"node_id": node_id, "drained": drained})

    # --- wiring ------------------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        proxy = ShutdownAnswering(self.proxy, self.shutdown_answer)
        routes: list[BaseRoute] = [Route(path, proxy, methods=["POST"]) for path in APIS]
        routes += [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/api/pool", self.api_pool, methods=["GET"]),
            Route("/admin/nodes/{node_id:path}/drain", self.drain, methods=["POST"]),
            Route("/admin/nodes/{node_id:path}/undrain", self.undrain, methods=["POST"]),
        ]
        return routes + _dashboard_routes(self)


# the cookie the dashboard keeps its key in, for its event stream (router/static/dashboard.js)
VIEW_COOKIE = "macpool_key"
SETTLE_S = 3.0  # at shutdown, the most the leases of cancelled requests are waited for (then they expire)


def redis_connection(settings: Settings) -> Connection:
    """The router's Redis connection (a server, Sentinel or Cluster: macpool/store/connect.py): one pool
    shared by the request path and the pool view."""
    # a blocking pool waits for a free connection under a burst instead of failing the request (redis-py's
    # default pool raises MaxConnectionsError at 100 connections). A pooled connection that a restarted
    # Redis (or a failed-over primary) has closed fails its next command: that command is retried on a new
    # connection (it never ran) instead of failing one client request per dead connection.
    return connect(settings.redis_url, max_connections=512, timeout=5.0, socket_connect_timeout=2.0,
                   socket_timeout=5.0)


def redis_client(settings: Settings) -> AnyRedis:
    """The client of :func:`redis_connection`."""
    return redis_connection(settings).client


def create_app(settings: Settings) -> Starlette:
    """The router application for ``settings``; services open and close with its lifespan."""
    router = Router(settings)
    app = Starlette(
        routes=router.routes(),
        middleware=[Middleware(OriginGuard, allowed=settings.cors_origins, hosts=settings.allowed_hosts),
                    Middleware(TrailingSlash)],
        lifespan=router.lifespan,
        exception_handlers=exception_handlers("router", log),
    )
    app.router.redirect_slashes = False  # TrailingSlash's rule instead: no redirect to the client's Host
    app.state.begin_shutdown = router.begin_shutdown  # the server's signal handler calls it (router/cli.py)
    return app


# what a browser application may read of an answer besides the CORS-safelisted headers
CORS_EXPOSED = ("Retry-After", "X-Macpool-Reason", "X-Macpool-Node", "X-Request-ID")


def with_cors(app: ASGIApp, origins: str | None) -> ASGIApp:
    """``app`` answering CORS for ``origins`` (settings.cors_origins): preflights, and the headers that let
    a page on those origins read the answers. Without origins, ``app`` itself: nothing added per chunk."""
    allowed = origin_list(origins or "")
    if not allowed:
        return app
    return _Cors(app, allow_origins=allowed, allow_methods=["GET", "POST"], allow_headers=["*"],
                 expose_headers=CORS_EXPOSED, max_age=600)


class _Cors(CORSMiddleware):
    """Starlette's CORS, refusing a preflight with the router's JSON error rather than plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        headers = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
        # "Disallowed CORS origin, method"
        return error_response(400, bytes(response.body).decode(), "cors_disallowed", headers=headers)


def _dashboard_routes(router: Router) -> list[BaseRoute]:
    """The dashboard (router/dashboard.py, built separately) plugs in here when it exists."""
    try:
        dashboard = importlib.import_module("router.dashboard")
    except ModuleNotFoundError as exc:
        if exc.name != "router.dashboard":
            raise
        return []
    routes: list[BaseRoute] = dashboard.routes(
        router.pool_json, router.settings, watch=router.scale, stopping=lambda: router.stopping,
        unviewable=router.unviewable,
    )
    return routes


def _usable_request_id(value: str | None) -> str | None:
    """A client's X-Request-ID, when it is short printable ASCII (it is echoed, forwarded and logged)."""
    if value and len(value) <= 200 and value.isascii() and value.isprintable():
        return value
    return None


def _json_content(content_type: str | None) -> None:
    """BadRequest 415 when the body is declared as something other than JSON: a page sends a body typed
    text/plain or as a form without asking first (no preflight). A body with no type at all is taken as JSON,
    as llama-server takes it: a page that sends one also sends its Origin, which router/origins.py refuses."""
    if content_type is None:
        return
    media = content_type.partition(";")[0].strip().lower()
    if media != "application/json":
        message = ("the request body must be JSON sent as Content-Type: application/json "
                   f"(got {content_type[:100]!r})")
        raise BadRequest(415, message, "unsupported_media_type")


def _inspect(body: bytes, default_model: str | None) -> tuple[dict[str, Any], str]:
    """The parsed body and its ``model``; the body itself is forwarded untouched."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest(400, "the request body is not valid JSON", "invalid_json") from None
    except RecursionError:
        raise BadRequest(400, "the request body is nested too deeply", "invalid_json") from None
    if not isinstance(payload, dict):
        raise BadRequest(400, "the request body must be a JSON object", "invalid_request")
    model = payload.get("model")
    if model is None or model == "":
        model = default_model or ""  # no model: any node
    if not isinstance(model, str):
        raise BadRequest(400, "`model` must be a string", "invalid_model")
    if not model.isascii():
        try:
            model.encode()
        except UnicodeEncodeError:  # a lone surrogate (a valid JSON escape, not a valid string)
            raise BadRequest(400, "`model` is not valid Unicode", "invalid_model") from None
    return payload, model
