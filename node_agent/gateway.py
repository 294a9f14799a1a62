"""The local gateway: a streaming proxy to llama-server with a hard in-flight cap and no local queue.

It serves every path of ``macpool/apis.py``. A generation path holds slots against the cap; a light one
(token counts, templates, tokenize) holds none and is bounded by a cap of its own (``--light-cap``). Over
either cap the answer is an immediate 503 ``node_full`` with ``Retry-After``: the router then tries
another node. The agent token travels in ``X-Macpool-Token`` (the client's ``Authorization`` belongs to
the router, which does not forward it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from macpool import relay
from macpool import upstream as http
from macpool.apis import APIS, GENERATION_PATHS, LIGHT_PATHS
from macpool.asgi import Guard, ShutdownAnswering, TrailingSlash
from macpool.contract import slots_needed
from macpool.errors import error_response, exception_handlers
from macpool.headers import HOP_BY_HOP, SESSION_HEADER, STREAM_HEADER, TOKEN_HEADER, connection_listed

from . import unstream
from .runtime import AnswerClock, Runtime, model_query
from .slots import UNNAMED, Claim, SlotNames, processing_slots, with_slot

# never forwarded upstream: hop-by-hop (RFC 9110 7.6.1), what httpx recomputes, and X-Conversation-Id
# (llama-server keeps generating after a disconnect when it is present)
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "x-conversation-id"}
_DROP_REQUEST_RAW = frozenset(name.encode("latin-1") for name in _DROP_REQUEST)
_DROP_RESPONSE_RAW = frozenset(name.encode("latin-1") for name in HOP_BY_HOP | {"server", "date"})
# the longest line of a stream the gateway assembles: a last event carries the whole answer (Responses)
# or the whole prompt (/completion), past aiohttp's own line limit when long, and far shorter than this on
# any context llama-server holds
MAX_EVENT_BYTES = 64 * 2**20

log = logging.getLogger("macpool.agent")


def _request_headers(request: Request) -> list[tuple[str, str]]:
    raw: list[tuple[bytes, bytes]] = request.scope["headers"]  # lower-case names (ASGI)
    listed = connection_listed(raw)
    return http.as_str(
        (name, value)
        for name, value in raw
        if name not in _DROP_REQUEST_RAW and name not in listed and not name.startswith(b"x-macpool-")
    )


def _response_headers(upstream: http.Response) -> list[tuple[bytes, bytes]]:
    """The upstream response's headers to pass on, as the raw list a response sends (lower-case names)."""
    raw = http.raw_headers(upstream)
    drop = _DROP_RESPONSE_RAW | connection_listed(raw)
    headers = [(name, value) for name, value in raw if name not in drop]
    if _is_event_stream(upstream) and not any(name == b"x-accel-buffering" for name, _ in headers):
        headers.append((b"x-accel-buffering", b"no"))
    return headers


def _is_event_stream(upstream: http.Response) -> bool:
    return http.content_type(upstream).startswith("text/event-stream")


_RECOMPUTED = frozenset({b"content-type", b"content-length", b"x-accel-buffering", b"cache-control"})


def _is_stream(upstream: http.Response) -> bool:
    return upstream.status == 200 and _is_event_stream(upstream)


class ProxyResponse(relay.Relay):
    """llama-server's answer relayed to the router (macpool/relay.py): measured as it streams (TTFT, decode
    speed), and what the request holds against the caps released when it ends."""

    upstream_name = "llama-server"

    def __init__(
        self, upstream: http.Response, runtime: Runtime, started: float, endpoint: str,
        release: Callable[[bool], None] | None,
    ) -> None:
        api = APIS.get(endpoint)  # GET /v1/models is in no API of the table: OpenAI's framing
        super().__init__(upstream, _response_headers(upstream), api.dialect if api is not None else "chat")
        self._runtime = runtime
        self._started = started
        self._held = release  # gives back what counts against a cap until the response ends (None: nothing)
        self._read_in_full = False  # llama-server's answer was read to its end (not the SSE "ended")
        self._clock = AnswerClock()
        runtime.metrics.requests.labels(endpoint, str(upstream.status)).inc()

    def relayed(self, chunk: bytes) -> None:
        if self.streaming:
            at = time.perf_counter()
            if self._clock.tick(at, chunk.count(b"data: "), self._runtime.in_flight):
                self._runtime.note_ttft(at - self._started)

    def completed(self) -> None:
        self._read_in_full = True
        if self.streaming and self.status_code == 200:
            concurrency = (self._clock.running + self._runtime.in_flight) / 2
            self._runtime.note_decode(self._clock.gaps, concurrency)

    def failed(self, kind: str) -> None:
        # a mid-stream upstream failure must not look like a normal end: the router reports it as one
        self._runtime.metrics.upstream_errors.labels("mid_stream").inc()

    async def finish(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held(self._read_in_full)


class Gateway:
    """The gateway's endpoints over one agent's runtime state (the agent owns clients and lifecycle)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._urls: dict[tuple[str, str, bytes], http.URL] = {}  # (upstream, path, query) -> parsed URL
        settings = runtime.settings  # as the agent's httpx client: --read-timeout bounds each wait
        self._timeouts = http.timeouts(settings.connect_timeout, settings.read_timeout, settings.read_timeout)
        self._token = settings.router_token()
        self._slots = SlotNames(settings.session_ttl)
        # _find_slot, one per request of unknown slot, and _look_at_slots after a request ended early
        self._finding: set[asyncio.Task[None]] = set()

    def _authorized(self, request: Request) -> bool:
        return token_given(request, self._token)

    def _not_serving(self) -> Response | None:
        """Why this node takes no request of any kind now (starting, draining, ...), or None."""
        state = self.runtime.state
        if state in ("draining", "draining-to-standby"):
            return self._unavailable("node_draining", f"this node is {state}")
        if state in ("starting", "unhealthy", "standby", "loading"):
            return self._unavailable("node_unavailable", f"this node is {state}")
        return None

    def _refusal(self, slots: int = 1) -> Response | None:
        """Why a new generation request holding ``slots`` cannot be admitted now, or None."""
        runtime = self.runtime
        refusal = self._not_serving()
        if refusal is not None:
            return refusal
        if slots > runtime.capacity > 0:
            message = (f"this request runs {slots} generations at once (its prompts times n); this node "
                       f"runs at most {runtime.capacity}")
            return self._unavailable("node_full", message)
        if not runtime.admitting or runtime.in_flight + slots > runtime.capacity:
            return self._unavailable("node_full", "this node is at capacity; retry on another node")
        return None

    def _light_refusal(self) -> Response | None:
        """Why a new light request cannot be admitted now, or None. Generation slots do not matter (nor
        memory pressure, which only pins them): it holds none."""
        runtime = self.runtime
        refusal = self._not_serving()
        if refusal is not None:
            return refusal
        if not runtime.admitting and runtime.state != "paging":  # llama-server stopped answering
            return self._unavailable("node_unavailable", "this node's llama-server is not answering")
        cap = runtime.settings.light_cap
        if runtime.light_in_flight >= cap:
            message = (f"this node answers at most {cap} token counts, templates and tokenizations at once; "
                       "retry on another node")
            return self._unavailable("node_full", message)
        return None

    def _unavailable(self, code: str, message: str) -> Response:
        self.runtime.metrics.rejections.labels(code).inc()
        return error_response(503, message, code, headers={"Retry-After": "1", "X-Macpool-Reason": code})

    async def generate(self, request: Request) -> Response:
        """A generation request: counts against the cap from when its body is in until its response ends."""
        if not self._authorized(request):
            self.runtime.metrics.rejections.labels("unauthorized").inc()
            return error_response(401, "missing or wrong agent token", "invalid_agent_token")
        refusal = self._refusal()  # a full node says so before reading the body
        if refusal is not None:
            return refusal
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return self._client_gone(request)
        except TimeoutError:
            return self._read_timed_out(request)
        # a body the router found asking for one streamed generation (it parsed it) is passed on as it is
        endpoint: str = request.scope["path"]
        parsed = None if request.headers.get(STREAM_HEADER) == "1" else unstream.parse(endpoint, body)
        # each of a request's generations (several prompts, n > 1) holds a slot of its own while it runs
        wanted = 1 if parsed is None else unstream.generations(endpoint, parsed)
        slots = slots_needed(wanted, self.runtime.total_slots)
        # asked again now that the body is in: a client that stalls its body must not hold a slot meanwhile
        refusal = self._refusal(slots)
        if refusal is not None:
            return refusal
        self.runtime.hold(slots)  # checked and taken with no await in between: atomic on one event loop
        claim, findable = self._slot(request, endpoint, body, wanted)
        finding = None
        if findable and self._slots.unknown(claim):
            finding = self._track(self._find_slot(claim))  # ends when found, else at release

        def release(ended: bool) -> None:
            self.runtime.release(slots)
            if finding is not None:
                finding.cancel()
            self._slots.give_back(claim, ended)
            if findable and self._slots.ended_early:
                self._track(self._look_at_slots())  # before a request in flight is found in a wrong slot

        return await self._relay(request, body, parsed, release, claim.slot)

    def _slot(self, request: Request, endpoint: str, body: bytes, generations: int) -> tuple[Claim, bool]:
        """The llama-server slot the request runs in (node_agent/slots.py): named, or where llama-server
        chooses (``UNNAMED``); given back as the request ends. And whether the slot llama-server chooses
        is worth finding: one generation, on slots that keep their own cells."""
        session = request.headers.get(SESSION_HEADER, "")
        doc = self.runtime.doc
        if generations != 1 or doc is None or doc.kv_unified or b'"id_slot"' in body:
            # (the client's own id_slot is passed on as it is)
            return self._slots.take("", self.runtime.total_slots, name=False), False
        claim = self._slots.take(session, self.runtime.total_slots, name=APIS[endpoint].names_slot)
        if session:
            self.runtime.metrics.slot_choices.labels(claim.why).inc()
        return claim, True

    def _track(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(work)
        self._finding.add(task)
        task.add_done_callback(self._finding.discard)
        return task

    async def _find_slot(self, claim: Claim) -> None:
        """Poll llama-server's ``/slots`` while ``claim`` runs in a slot the agent does not know, until it
        is found (node_agent/slots.py ``observe``): often at first, later while longer than a second."""
        pause = 0.05
        while self._slots.unknown(claim):
            await self._look_at_slots()
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)

    async def _look_at_slots(self) -> None:
        """Tell the slot names what llama-server's ``/slots`` says now."""
        query = model_query(self.runtime.model)
        try:
            url = self.runtime.upstream_url + "/slots" + query
            answer = await self.runtime.client().get(url, timeout=2.0)
            if answer.status_code == 200 and self._slots.observe(processing_slots(answer.json())):
                self.runtime.metrics.slots_found.inc()
        except (httpx.HTTPError, ValueError, RuntimeError):
            # llama-server busy, restarting, or with /slots off, or the agent stopping (its client closed):
            # the slot stays unknown
            pass

    async def light(self, request: Request) -> Response:
        """A light request (token counts, templates, tokenize): holds no generation slot, counts against the
        light cap from when its body is in until its response ends."""
        if not self._authorized(request):
            self.runtime.metrics.rejections.labels("unauthorized").inc()
            return error_response(401, "missing or wrong agent token", "invalid_agent_token")
        refusal = self._light_refusal()
        if refusal is not None:
            return refusal
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return self._client_gone(request)
        except TimeoutError:
            return self._read_timed_out(request)
        refusal = self._light_refusal()
        if refusal is not None:
            return refusal
        self.runtime.hold_light()
        return await self._relay(request, body, None, lambda _: self.runtime.release_light(), prompt=False)

    async def _relay(
        self, request: Request, body: bytes, parsed: dict[str, Any] | None, release: Callable[[bool], None],
        slot: int = UNNAMED, prompt: bool = True,
    ) -> Response:
        """The answer to an admitted request; ``release`` gives back what it holds, once, when it ends, and
        says whether llama-server finished it. ``prompt``: a request llama-server processes a prompt for in
        a slot (not a light one)."""
        # llama-server sends its response head only with the first token, so the wait for it covers the
        # prefill (and, passed through, a whole non-streamed generation): the client is watched from here
        guard = Guard(request.receive)
        response: Response | None = None
        ended = False
        try:
            response = await guard.run(self._forward(request, body, parsed, release, slot, prompt))
            if response is None:
                response = self._client_gone(request)  # cancelled, the upstream connection is closed
            else:
                # llama-server answered in full, or never had the request; after a 5xx (llama-server gone
                # or timed out with it, say) its task may still run
                ended = response.status_code < 500
        finally:
            if isinstance(response, ProxyResponse):
                response.guard = guard  # the same watch goes on; the response releases when it ends
            else:
                guard.finish()  # on every other path (an error included: its answer must not be cancelled)
                release(ended)
        return response

    async def _forward(
        self, request: Request, body: bytes, parsed: dict[str, Any] | None, release: Callable[[bool], None],
        slot: int, prompt: bool,
    ) -> Response:
        """The upstream's answer to the request: relayed, or assembled from a stream asked for instead."""
        started = time.perf_counter()  # TTFT counts from here: llama-server's head comes with the first token
        endpoint: str = request.scope["path"]
        streamed = unstream.streamed(endpoint, parsed)
        sent = streamed or body
        if slot != UNNAMED:
            sent = with_slot(sent, slot) or sent
        # llama-server sends its answer's head with the first token: until then it processes the prompt
        since = self.runtime.prompt_sent() if prompt else None
        try:
            upstream = await self._send(request, sent)
        finally:
            if since is not None:
                self.runtime.prompt_answered(since)
        if isinstance(upstream, Response):
            return upstream
        if streamed is not None and _is_stream(upstream):
            return await self._assembled(upstream, endpoint, parsed or {}, started)
        return ProxyResponse(upstream, self.runtime, started, endpoint, release)

    async def _body(self, request: Request) -> bytes:
        """The request's body, bounded in time (TimeoutError): a client trickling it holds no slot, but
        a handler and a connection."""
        async with asyncio.timeout(self.runtime.settings.request_read_timeout):
            return await request.body()

    def _read_timed_out(self, request: Request) -> Response:
        self.runtime.metrics.requests.labels(request.scope["path"], "408").inc()
        message = f"the request body was not received within {self.runtime.settings.request_read_timeout:g} s"
        # the rest of the body is unread: the connection ends with the answer
        return error_response(408, message, "request_timeout", headers={"Connection": "close"})

    def _client_gone(self, request: Request) -> Response:
        self.runtime.metrics.requests.labels(request.scope["path"], "499").inc()
        return Response(status_code=499)  # nobody reads this

    async def _assembled(
        self, upstream: http.Response, endpoint: str, original: dict[str, Any], started: float
    ) -> Response:
        """Collect a stream asked for on the client's behalf into one JSON reply (see unstream.py).

        The request's guard watches the client meanwhile: if it goes, the collection is cancelled and the
        upstream stream closed at once, which is what makes llama-server cancel the task and free the slot.
        """
        assembler = unstream.assembler(endpoint)
        metrics = self.runtime.metrics
        clock = AnswerClock()
        try:
            async for line in http.lines(upstream, MAX_EVENT_BYTES):
                if line.startswith("data: "):
                    at = time.perf_counter()
                    if clock.tick(at, 1, self.runtime.in_flight):
                        self.runtime.note_ttft(at - started)
                assembler.feed_line(line)
            assembler.end()
        except httpx.HTTPError:
            metrics.upstream_errors.labels("mid_response").inc()
            metrics.requests.labels(endpoint, "502").inc()
            return error_response(502, "llama-server failed mid-response", "upstream_midstream")
        finally:
            http.close(upstream)
        if assembler.error is not None:
            code = assembler.error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            metrics.requests.labels(endpoint, str(status)).inc()
            return JSONResponse({"error": assembler.error}, status_code=status)
        if not assembler.complete:
            metrics.upstream_errors.labels("mid_response").inc()
            metrics.requests.labels(endpoint, "502").inc()
            message = "llama-server's stream ended before its last event"
            return error_response(502, message, "upstream_midstream")
        self.runtime.note_decode(clock.gaps, (clock.running + self.runtime.in_flight) / 2)
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in _response_headers(upstream) if name not in _RECOMPUTED}
        self.runtime.metrics.requests.labels(endpoint, "200").inc()
        return JSONResponse(assembler.result(original), headers=headers)

    async def passthrough(self, request: Request) -> Response:
        """A read-only request (``GET /v1/models``): proxied, not counted against the cap."""
        if not self._authorized(request):
            return error_response(401, "missing or wrong agent token", "invalid_agent_token")
        try:
            upstream = await self._send(request, await self._body(request))
        except ClientDisconnect:
            return self._client_gone(request)
        except TimeoutError:
            return self._read_timed_out(request)
        if isinstance(upstream, Response):
            return upstream
        started, endpoint = time.perf_counter(), request.scope["path"]
        return ProxyResponse(upstream, self.runtime, started, endpoint, release=None)

    async def _send(self, request: Request, body: bytes) -> http.Response | Response:
        runtime = self.runtime
        endpoint: str = request.scope["path"]
        # straight through the client's session: a relay needs none of an httpx client's redirects, auth
        # flow or cookie jar (which would carry one caller's cookies into another's requests)
        url, headers = self._url(endpoint, request.scope["query_string"]), _request_headers(request)
        try:
            return await runtime.transport().send(request.method, url, headers, body, self._timeouts)
        except httpx.TransportError as exc:
            # llama-server is down (or went down with this request): nothing reached the client, so this is
            # "this node is unavailable" - the router tries another node - and the node stops admitting now
            runtime.metrics.upstream_errors.labels(type(exc).__name__).inc()
            runtime.metrics.requests.labels(endpoint, "503").inc()
            runtime.upstream_lost()
            return self._unavailable("node_unavailable", "this node's llama-server is not reachable")
        except httpx.HTTPError as exc:
            runtime.metrics.upstream_errors.labels(type(exc).__name__).inc()
            runtime.metrics.requests.labels(endpoint, "502").inc()
            return error_response(502, "the node's llama-server is not reachable", "upstream_unavailable")

    def _url(self, path: str, query: bytes) -> http.URL:
        """The parsed upstream URL, cached: a URL is parsed once, not on every request."""
        base = self.runtime.upstream_url
        url = self._urls.get((base, path, query))
        if url is None:
            if len(self._urls) > 1024:  # query strings are the client's: never let the cache grow unbounded
                self._urls.clear()
            text = base + path + ("?" + query.decode("latin-1") if query else "")
            url = self._urls[base, path, query] = http.url(text)
        return url

    def shutdown_answer(self, request: Request) -> Response:
        """A request cancelled by the agent's stop (its drain timeout passed) before its answer began: the
        router tries another node (macpool/asgi.py ``ShutdownAnswering``)."""
        self.runtime.metrics.requests.labels(request.scope["path"], "503").inc()
        return self._unavailable("node_draining", "this node shut down before answering; retry elsewhere")

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def status(self, request: Request) -> Response:
        return JSONResponse(status_of(self.runtime, private=self._authorized(request)))

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(runtime: Runtime) -> Starlette:
    """The gateway app over one agent's runtime state."""
    gateway = Gateway(runtime)
    generate = ShutdownAnswering(gateway.generate, gateway.shutdown_answer)
    light = ShutdownAnswering(gateway.light, gateway.shutdown_answer)
    routes = [Route(path, generate, methods=["POST"]) for path in GENERATION_PATHS]
    routes += [Route(path, light, methods=["POST"]) for path in LIGHT_PATHS]
    routes += [
        Route("/v1/models", gateway.passthrough, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/status", gateway.status, methods=["GET"]),
        Route("/metrics", gateway.metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(TrailingSlash)],
                    exception_handlers=exception_handlers("agent", log))
    app.router.redirect_slashes = False  # TrailingSlash's rule instead: no redirect to the client's Host
    return app


def token_given(request: Request, token: str | None) -> bool:
    """Whether ``request`` carries the agent token (any request does where there is none)."""
    if not token:
        return True
    return hmac.compare_digest(request.headers.get(TOKEN_HEADER, "").encode(), token.encode())


def status_of(runtime: Runtime, private: bool = True) -> dict[str, object]:
    """A node's ``/status``: its last heartbeat document, its live figures and the agent's details (without
    the model's path and llama-server's command line unless ``private``: the token was given)."""
    return {
        "node": runtime.doc.model_dump(mode="json") if runtime.doc else None,
        "state": runtime.state,
        "capacity": runtime.capacity,
        "in_flight": runtime.in_flight,
        "light_in_flight": runtime.light_in_flight,
        "admitting": runtime.admitting,
        **details(runtime, private),
    }


# what /status shows only with the agent token: where the Mac keeps its files, and how it runs llama-server
_PRIVATE_DETAILS = {"model": ("path",), "llama_server": ("argv",)}


def details(runtime: Runtime, private: bool = True) -> dict[str, object]:
    """The agent's extra ``/status`` figures, the callable ones read now."""
    out = {key: value() if callable(value) else value for key, value in runtime.details.items()}
    if not private:
        for key, hidden in _PRIVATE_DETAILS.items():
            value = out.get(key)
            if isinstance(value, dict):
                out[key] = {k: v for k, v in value.items() if k not in hidden}
    return out


class _ByModel(Collector):
    """Every model's own registry as one, each sample labelled with its model."""

    def __init__(self, runtimes: dict[str, Runtime]) -> None:
        self.runtimes = runtimes

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, runtime in self.runtimes.items():
            for metric in runtime.metrics.registry.collect():
                family = families.get(metric.name)
                if family is None:
                    family = families[metric.name] = Metric(metric.name, metric.documentation, metric.type,
                                                            metric.unit)
                family.samples += [s._replace(labels={**s.labels, "model": name}) for s in metric.samples]
        yield from families.values()


def create_models_app(runtimes: dict[str, Runtime], agent: Runtime) -> ASGIApp:
    """Several models on one Mac (node_agent/models.py): each model's gateway under ``/m/<name>`` (its
    node's URL), and the agent's own ``/health``, ``/status`` (every model's) and ``/metrics`` (every
    model's, labelled ``model``). ``runtimes`` may change while it serves (models the pool declares come and
    go: node_agent/pool_models.py): each model's gateway is built at its first request."""
    apps: dict[str, ASGIApp] = {}
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_ByModel(runtimes))
    token = agent.settings.router_token()  # (a credential file is read once, not per request)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def status(request: Request) -> Response:
        private = token_given(request, token)
        models = {name: status_of(runtime, private) for name, runtime in runtimes.items()}
        return JSONResponse({"models": models, **details(agent, private)})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    routes = [Route("/health", health, methods=["GET"]), Route("/status", status, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    root = Starlette(routes=routes, exception_handlers=exception_handlers("agent", log))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] == "http" and path.startswith("/m/"):
            name, slash, rest = path[len("/m/"):].partition("/")
            runtime = runtimes.get(name)
            model_app = apps.get(name) if runtime is not None else None
            if runtime is not None and model_app is None:
                model_app = apps[name] = create_app(runtime)
            if runtime is None:
                apps.pop(name, None)
            if model_app is None:
                response = error_response(404, f"no model {name!r} on this agent", "model_not_found")
                await response(scope, receive, send)
                return
            inner = slash + rest or "/"
            await model_app({**scope, "path": inner, "raw_path": inner.encode()}, receive, send)
            return
        await root(scope, receive, send)

    return app
