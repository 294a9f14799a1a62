"""Forwarding one admitted request to a node's agent and relaying the answer byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from starlette.responses import Response
from starlette.types import Receive, Send
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from macpool import relay
from macpool import upstream as http
from macpool.asgi import Guard
from macpool.contract import NodeDoc, slots_needed
from macpool.headers import HOP_BY_HOP_RAW, SESSION_HEADER, STREAM_HEADER, TOKEN_HEADER, connection_listed
from router import tokens
from router.admission import FULL_MESSAGE, Admission, Lease, Limited, Rejected, Ticket, prefill_seconds
from router.cold_start import ColdStart
from router.dialects import Dialect
from router.dialects.chat import DIALECT as CHAT
from router.light import LightLimits
from router.metrics import RouterMetrics
from router.pool import ModelNotFound, NoNodes, PoolView
from router.settings import Settings

log = logging.getLogger("macpool.router")

# never sent upstream: the client's key is for the router, the rest is rebuilt or private
_DROP_UPSTREAM = HOP_BY_HOP_RAW | {
    b"host", b"content-length", b"authorization", b"x-api-key", b"x-conversation-id", b"x-request-id",
}
# the router's own server/date headers are written by uvicorn; CORS is the router's policy (--cors-origins),
# not llama-server's (which lets any origin read its answers)
_CORS = {b"access-control-allow-origin", b"access-control-allow-credentials", b"access-control-allow-methods",
         b"access-control-allow-headers", b"access-control-expose-headers", b"access-control-max-age"}
_DROP_DOWNSTREAM = HOP_BY_HOP_RAW | _CORS | {b"server", b"date", b"x-request-id"}
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_STREAMED = (STREAM_HEADER, "1")
# the code of the error event an agent ends a stream with when llama-server fails mid-stream, looked for in
# the last bytes of a stream only (node_agent/gateway.py ProxyResponse)
_AGENT_MIDSTREAM = b'"upstream_midstream"'
_TAIL = 512
_TAIL_CHUNKS = 3  # the last chunks of an answer kept (as references) to read its usage from at its end
_ERROR_DOCUMENT_BYTES = 65536  # a node's error answer is read whole to be put in the caller's dialect
COUNT_TIMEOUT_S = 10.0  # a node counts a prompt in milliseconds; past this the bound stands
# an agent saying node_full is asked again (from 5 ms apart, doubling, with jitter) for up to 0.5 s before
# another node is tried
_CATCH_UP_PAUSE, _CATCH_UP_S = 0.005, 0.5
_CATCH_UP_WAIT = wait_exponential_jitter(multiplier=_CATCH_UP_PAUSE, max=_CATCH_UP_S / 4,
                                         jitter=_CATCH_UP_PAUSE)


# an idle pooled connection to an agent is given up after this long, well before the agent closes it
# (node_agent/agent.py KEEP_ALIVE_S): a request written on a connection as the agent closes it gets no answer
IDLE_S = 30.0


def new_upstream(tls: ssl.SSLContext | None = None) -> http.Upstream:
    """One pooled client for every call to an agent; https:// agents are checked with ``tls``
    (``macpool.upstream.client_tls``).

    The forwarder sends through ``Upstream.send``: the router needs none of an ``httpx.AsyncClient``'s
    redirects, auth flows or cookie jar (which would even carry one agent's cookies into other clients'
    requests).
    """
    return http.Upstream(IDLE_S, max_connections=4096, tls=tls)


@dataclass
class Call:
    """What the router knows about one client request."""

    path: str
    body: bytes
    model: str
    stream: bool
    headers: list[tuple[bytes, bytes]]
    request_id: str
    arrived: float
    ticket: Ticket = field(default_factory=Ticket)
    dialect: Dialect = CHAT  # its API's: what its answers and errors look like
    query: bytes = b""  # the query string, passed on
    count_body: bytes | None = None  # what a node counts its prompt from (router/tokens.py)
    exact: bool = False  # ticket.prompt_tokens is a node's count, not the router's bound
    too_long: Response | None = None  # the last node's answer that the prompt is over its context
    node: str = ""  # the node it is sent to, while it is
    session: str = ""  # a digest of the session the client names: its node keeps it in one slot

    @property
    def generations(self) -> int:
        return self.ticket.generations

    def counted(self, prompt_tokens: int) -> None:
        """A node counted the prompt: the count replaces the bound."""
        self.ticket = dataclasses.replace(self.ticket, prompt_tokens=prompt_tokens)
        self.exact = True

    def uncounted(self) -> None:
        """No node counted a prompt whose bound could decide where it goes: admission does not count it (a
        bound would keep it from nodes that may well take it; llama-server's own answer decides there)."""
        self.ticket = dataclasses.replace(self.ticket, prompt_tokens=0)

    def error(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
        """An error answer in the caller's dialect."""
        return self.dialect.error(status, message, code, headers)


class Hold(Protocol):
    """What a forwarded request holds on its node - a reserved slot, or a light request's place - until its
    answer ends. Given back exactly once: by the Relay when there is one, else where it was attempted."""

    node: NodeDoc

    async def give_back(self, failed: bool = False) -> None: ...


class Reserved:
    """A generation's lease as a Hold: given back to Redis through admission."""

    def __init__(self, lease: Lease, admission: Admission) -> None:
        self.lease = lease
        self.node = lease.node
        self.admission = admission

    async def give_back(self, failed: bool = False) -> None:
        await self.admission.release(self.lease, failed=failed)


def fits(call: Call, node: NodeDoc, capacity: int | None = None) -> bool:
    """Whether ``node`` could run all of the request's generations at once, were it idle (with ``capacity``:
    were that its capacity), and its prompt fits the node's context (as far as a node's count says)."""
    cap = node.capacity if capacity is None else capacity
    runs = call.generations == 1 or slots_needed(call.generations, node.total_slots) <= cap
    return runs and (not call.exact or holds(node, call.ticket.prompt_tokens))


def context(node: NodeDoc) -> int:
    """The most tokens one request may hold on ``node`` (0: not known)."""
    return node.seq_ctx or node.ctx_per_slot


def holds(node: NodeDoc, prompt_tokens: int) -> bool:
    """Whether a prompt of ``prompt_tokens`` is one llama-server on ``node`` takes (it refuses a prompt of
    as many tokens as its context, or more)."""
    ctx = context(node)
    return ctx == 0 or prompt_tokens < ctx


def full_capacity(node: NodeDoc) -> int:
    """What ``node`` runs when it is itself again: its capacity lowered by memory pressure, or not yet known
    while it starts, is the smallest of its capacity's terms."""
    b = node.capacity_breakdown
    terms = [term for term in (b.configured, b.memory, b.calibrated) if term is not None]
    return max(node.capacity, min(terms, default=0))


class _NodeFull(Exception):
    """The agent said node_full: asked again in a moment."""


class _Retry(Exception):
    """This node cannot take the request, but another one may. ``failed``: the node failed it (its slot is
    not handed to a waiter, who would meet the same failure); not so for a prompt over its context."""

    def __init__(self, kind: str, failed: bool = True) -> None:
        super().__init__(kind)
        self.kind = kind
        self.failed = failed


class Forwarder:
    def __init__(
        self,
        settings: Settings,
        client: http.Upstream,
        pool: PoolView,
        admission: Admission,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.client = client
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        # no read timeout: an agent that stops answering mid-stream is the relay watchdog's (idle timeout)
        self._timeouts = http.timeouts(connect=settings.connect_timeout, read=None)
        self._urls: dict[tuple[str, str, bytes], http.URL] = {}  # (node url, path, query) -> parsed URL
        self.cold_start = ColdStart(settings, pool, admission)
        self.light = LightLimits(settings.light_concurrency)

    async def handle(self, call: Call, receive: Receive, light: bool = False) -> Response:
        """Admit, forward (failing over before the first byte), and hand back a relaying response; a
        ``light`` request (macpool/apis.py) skips admission for a place under its node's light cap.

        A client that goes away while its request waits in the queue or for the first byte cancels it
        there and then: the queue entry, the reservation and the upstream request are all given back.
        """
        if not light:
            refusal = self.refusal_from_memory(call)
            if refusal is not None:
                return refusal
        guard = Guard(receive)
        response = await guard.run(self._light(call) if light else self._handle(call))
        if response is None:
            self.metrics.requests.labels(model=call.model, node=call.node, status="client_closed").inc()
            return Response(status_code=499)  # nobody is listening any more
        if isinstance(response, Relay):
            response.guard = guard  # the same watch goes on while the answer is relayed
        else:
            guard.finish()
        return response

    def refusal_from_memory(self, call: Call) -> Response | None:
        """The 503 for a request whose model Redis has just called full (admission's memo), else None.

        Decided without awaiting anything: a refusal under overload costs no Redis round trip.
        """
        if not self.admission.known_full(call.model):
            return None
        try:
            self.pool.candidates(call.model)
        except (NoNodes, ModelNotFound):
            return None  # _handle answers those
        self.pool.requests.mark()
        return self.rejection(self.admission.reject("pool_full", FULL_MESSAGE), call)

    async def _handle(self, call: Call) -> Response:
        self.pool.requests.mark()
        if call.ticket.prompt_tokens and not call.exact:
            await self._count(call)
        too_large = self._too_large(call) if call.generations > 1 else self._too_long(call)
        if too_large is not None:
            return too_large
        if self.cold_start.needed(call.model):
            try:
                await self.cold_start.wait(call.ticket)
            except Rejected as rejected:
                return self.rejection(rejected, call)
            except Limited as limited:
                return self.limited(limited, call)
        tried: set[str] = set()
        failures: set[str] = set()  # what each node tried answered
        for _ in range(self.settings.max_attempts):
            if call.too_long is not None:  # a node counted the prompt over its context: any larger one?
                too_long = self._too_long(call)
                if too_long is not None:
                    return too_long
            try:
                docs = self.pool.candidates(call.model)
                if tried and not [d for d in docs if d.node_id not in tried and fits(call, d)]:
                    break
                lease = await self.admission.acquire(
                    lambda: [d for d in self.pool.candidates(call.model)
                             if d.node_id not in tried and fits(call, d)],
                    call.ticket,
                    tried,
                )
            except Rejected as rejected:
                return self.rejection(rejected, call)
            except Limited as limited:
                return self.limited(limited, call)
            except (NoNodes, ModelNotFound) as exc:
                return self.unserved(call, exc)
            try:
                return await self._attempt(call, Reserved(lease, self.admission))
            except _Retry as retry:
                tried.add(lease.node.node_id)
                failures.add(retry.kind)
        return self.exhausted(call, failures)

    async def _light(self, call: Call) -> Response:
        """A light request: the ready node of its model with the fewest light requests this router has in
        flight there, under the cap; another one if that node refuses before answering."""
        tried: set[str] = set()
        failures: set[str] = set()
        for _ in range(self.settings.max_attempts):
            try:
                docs = [d for d in self.pool.candidates(call.model) if d.node_id not in tried]
            except (NoNodes, ModelNotFound) as exc:
                return self.unserved(call, exc)
            if not docs:
                break
            hold = self.light.take(docs)
            if hold is None:
                message = f"every node of the model has {self.light.per_node} light requests in flight"
                return self.rejection(self.admission.reject("pool_full", message), call)
            try:
                return await self._attempt(call, hold)
            except _Retry as retry:
                tried.add(hold.node.node_id)
                failures.add(retry.kind)
        return self.exhausted(call, failures)

    async def _attempt(self, call: Call, hold: Hold) -> Response:
        """Forward on the node ``hold`` holds. The hold goes with the Relay that answers, or is given back
        here: the one place a forwarded request's hold ends other than the Relay."""
        call.node = hold.node.node_id
        try:
            response = await self._open(call, hold)
        except _Retry as retry:
            call.node = ""
            await hold.give_back(failed=retry.failed)
            raise
        except BaseException:  # cancelled because the client left (counted as the node's)
            await hold.give_back()
            raise
        if not isinstance(response, Relay):
            await hold.give_back(failed=True)  # an error answer: the node failed the request
        return response

    def unserved(self, call: Call, exc: NoNodes | ModelNotFound) -> Response:
        """No ready node for the model (503 no_nodes), or no node serves it at all (404)."""
        if isinstance(exc, ModelNotFound):
            self.metrics.requests.labels(model="", node="", status="404").inc()
            return call.error(404, f"model {call.model!r} is not served by any node", "model_not_found")
        # a model no node serves is only the client's word: labelled by it, each new name would be a new
        # series, kept for good
        served = any(call.model in doc.models for doc in self.pool.fresh_nodes())
        refused = self.admission.reject("no_nodes", str(exc))
        return self.rejection(refused, call, model=call.model if served else "")

    def exhausted(self, call: Call, failures: set[str]) -> Response:
        """Every node tried refused before answering: a node that answered 503 (full; draining, loading,
        its llama-server down) makes the answer a 503 to retry later, whatever the other nodes tried did;
        only nodes that could not be reached at all: 502; a prompt over the context of every node that could
        take it: the last such node's 400."""
        if failures == {"context"} and call.too_long is not None:
            self.metrics.requests.labels(model=call.model, node="", status="400").inc()
            return call.too_long
        failures = failures - {"context"}
        mixed = len(failures) > 1
        if "node_full" in failures:
            message = "no node tried could take the request" if mixed else "every node tried was full"
            return self.rejection(self.admission.reject("pool_full", message), call)
        if "unavailable" in failures:
            message = "no node tried could take the request" if mixed else "every node tried was unavailable"
            return self.rejection(self.admission.reject("no_nodes", message), call)
        self.metrics.requests.labels(model=call.model, node="", status="502").inc()
        return call.error(502, "no node could be reached", "upstream_unavailable")

    async def _count(self, call: Call) -> None:
        """Have a node of the model count the prompt exactly, where the router's bound could decide where
        it goes (router/tokens.py); on any failure the bound stands."""
        try:
            docs = self.pool.candidates(call.model)
        except (NoNodes, ModelNotFound):
            return
        dialect = call.dialect
        if not tokens.worth_counting(call.ticket.prompt_tokens, docs):
            return
        hold = self.light.take(docs) if dialect.count_path and call.count_body else None
        if hold is None:
            call.uncounted()
            return
        node = hold.node
        url = self._url(node.url, dialect.count_path, b"")
        headers = [("content-type", "application/json"), ("x-request-id", call.request_id)]
        token = self.pool.trust.agent_token(node)
        if token:
            headers.append((TOKEN_HEADER, token))
        upstream: http.Response | None = None
        try:
            async with asyncio.timeout(COUNT_TIMEOUT_S):
                upstream = await self.client.send("POST", url, headers, call.count_body, self._timeouts)
                answer = await http.read(upstream) if upstream.status == 200 else b""
            count = tokens.counted(json.loads(answer)) if answer else None
        except (httpx.HTTPError, TimeoutError, ValueError) as exc:
            log.info("node %s could not count a prompt (%s); the router's bound stands", node.node_id,
                     type(exc).__name__, extra=_ids(node.node_id, call))
            count = None
        finally:
            http.close(upstream)
            await hold.give_back()
        if count is not None:
            call.counted(count)
        else:
            call.uncounted()

    def _too_long(self, call: Call) -> Response | None:
        """400 for a prompt a node counted over every context in the pool, else None: a prompt no node of its
        model could ever take. Only on a node's count: the router's own bound never refuses."""
        if not call.exact:
            return None
        docs = [doc for doc in self.pool.fresh_nodes() if not call.model or call.model in doc.models]
        contexts = [context(doc) for doc in docs]
        if not docs or any(ctx == 0 or call.ticket.prompt_tokens < ctx for ctx in contexts):
            return None
        return self.context_refusal(call, max(contexts))

    def context_refusal(self, call: Call, largest: int) -> Response:
        self.metrics.requests.labels(model=call.model, node="", status="400").inc()
        # Anthropic's own wording, which Claude Code recognises (and offers to compact the conversation)
        message = (f"prompt is too long: {call.ticket.prompt_tokens} tokens > {largest} maximum (the largest "
                   f"context of any node serving {call.model or 'this pool'})")
        return call.error(400, message, "context_length_exceeded")

    def _too_large(self, call: Call) -> Response | None:
        """400 for a request running more generations at once than any node in the pool runs, else None.

        Every node serving the model counts, at its full capacity: one draining, drained, starting, paging or
        behind an open circuit comes back, and a request that only it can run is a 503 meanwhile, to retry.
        """
        try:
            self.pool.candidates(call.model)
        except (NoNodes, ModelNotFound):
            return None  # answered by _handle
        docs = [doc for doc in self.pool.fresh_nodes() if not call.model or call.model in doc.models]
        sizes = [full_capacity(doc) for doc in docs]
        if any(size == 0 or fits(call, doc, size) for doc, size in zip(docs, sizes, strict=True)):
            return None  # (0: a node starting, its size not known yet)
        self.metrics.requests.labels(model=call.model, node="", status="400").inc()
        message = (f"this request runs {call.generations} generations at once (its prompts times n); no node "
                   f"in the pool runs more than {max(sizes)}")
        return call.error(400, message, "too_many_generations")

    def rejection(self, rejected: Rejected, call: Call, model: str | None = None) -> Response:
        self.pool.rejections.mark()
        self.metrics.rejections.labels(reason=rejected.reason).inc()
        label = call.model if model is None else model
        self.metrics.requests.labels(model=label, node="", status="503").inc()
        headers = {"Retry-After": str(rejected.retry_after), "X-Macpool-Reason": rejected.reason,
                   "X-Request-ID": call.request_id}
        return call.error(503, str(rejected), rejected.reason, headers=headers)

    def limited(self, limited: Limited, call: Call) -> Response:
        self.metrics.key_limited.labels(tenant=limited.tenant).inc()
        self.metrics.requests.labels(model=call.model, node="", status="429").inc()
        headers = {"Retry-After": str(limited.retry_after), "X-Macpool-Reason": "key_limit",
                   "X-Request-ID": call.request_id}
        return call.error(429, str(limited), "key_limit", headers=headers)

    async def _open(self, call: Call, hold: Hold) -> Response:
        """Send upstream and wait for the first byte; raise _Retry when another node should try. Any answer
        but a Relay means the node failed the request (the caller gives the hold back)."""
        node = hold.node
        url, headers = self._url(node.url, call.path, call.query), self._upstream_headers(call, node)
        upstream: http.Response | None = None
        try:
            async with asyncio.timeout(self._first_byte_timeout(call, node)):
                upstream = await self._post(node.node_id, url, headers, call.body)
                chunks = http.chunks(upstream)
                first = await anext(chunks, b"")
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.pool.connect_failed(node.node_id)
            self._upstream_error(node.node_id, "connect")
            # the reason in full: a refused certificate says which check failed
            log.warning("node %s: connect failed (%s: %s)", node.node_id, type(exc).__name__, exc,
                        extra=_ids(node.node_id, call))
            raise _Retry("connect") from None
        except TimeoutError:
            http.close(upstream)
            self.pool.connect_failed(node.node_id)  # a hung node: stop sending it traffic
            self._upstream_error(node.node_id, "first_byte_timeout")
            self.metrics.requests.labels(model=call.model, node=node.node_id, status="504").inc()
            which = "first-byte" if call.stream else "response"
            return call.error(504, f"the node did not answer within the {which} timeout", "upstream_timeout")
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
            # the connection died before the answer's first byte (typically a keep-alive connection an agent
            # closed as it shut down, or an agent killed between its answer's head and body): nothing reached
            # the client, so another node may take the request
            http.close(upstream)
            self._upstream_error(node.node_id, "reset")
            log.warning("node %s: %s before an answer; trying another node", node.node_id, type(exc).__name__,
                        extra=_ids(node.node_id, call))
            raise _Retry("reset") from None
        except httpx.HTTPError as exc:
            return self._failed_before_first_byte(call, node.node_id, upstream, exc)
        except BaseException:  # _Retry, or cancelled because the client left
            http.close(upstream)
            raise
        self.metrics.ttft.observe(time.monotonic() - call.arrived)
        if upstream.status in (401, 403):
            # the agent refused the router's token: a deployment error, not the client's
            http.close(upstream)
            self._upstream_error(node.node_id, "auth")
            self.metrics.requests.labels(model=call.model, node=node.node_id, status="502").inc()
            return call.error(502, "the node refused the router's agent token", "upstream_auth")
        if upstream.status >= 400 and http.content_type(upstream).startswith("application/json"):
            first, answer = await self._error_answer(call, node.node_id, upstream, first, chunks)
            if answer is not None:
                return answer
        return Relay(self, call, hold, upstream, first, chunks)

    async def _error_answer(
        self, call: Call, node_id: str, upstream: http.Response, first: bytes, chunks: AsyncIterator[bytes]
    ) -> tuple[bytes, Response | None]:
        """A node's error document (llama-server's, OpenAI-shaped), read whole and answered in the caller's
        dialect; or, past the size of an error document, what was read so far, to relay with the rest."""
        body = bytearray(first)
        async for chunk in chunks:
            body += chunk
            if len(body) > _ERROR_DOCUMENT_BYTES:
                return bytes(body), None
        http.close(upstream)
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        translated = call.dialect.upstream_error(upstream.status, document) \
            if isinstance(document, dict) else None
        answer = Response(translated if translated is not None else bytes(body), status_code=upstream.status,
                          media_type="application/json",
                          headers={"X-Request-ID": call.request_id, "X-Macpool-Node": node_id})
        prompt = _over_context(upstream.status, document)
        if prompt is not None:
            # another node may have the context for it: counted now, tried there before the client hears
            call.counted(max(prompt, call.ticket.prompt_tokens if call.exact else 0))
            call.too_long = answer
            self._upstream_error(node_id, "context")
            raise _Retry("context", failed=False)
        self.metrics.requests.labels(model=call.model, node=node_id, status=str(upstream.status)).inc()
        return bytes(body), answer

    async def _post(
        self, node_id: str, url: http.URL, headers: list[tuple[str, str]], body: bytes
    ) -> http.Response:
        """The agent's answer; a 503 raises _Retry (a node_full once the agent has had a moment to catch up).

        Redis has just reserved this slot, so an agent calling itself full has most often not yet seen a
        request end whose slot Redis already gave on (its client gone, the router's release first): asked
        again a few ms later, it takes the request. Only a refusal that lasts fails over to another node.
        """
        try:
            try:
                return await self._ask(node_id, url, headers, body)
            except _NodeFull:  # the retries are the rare path: tenacity's bookkeeping only for them
                return await self._ask_again(node_id, url, headers, body)
        except _NodeFull:
            self._upstream_error(node_id, "node_full")
            raise _Retry("node_full") from None

    @retry(stop=stop_after_delay(_CATCH_UP_S), wait=_CATCH_UP_WAIT, retry=retry_if_exception_type(_NodeFull),
           reraise=True)
    async def _ask_again(
        self, node_id: str, url: http.URL, headers: list[tuple[str, str]], body: bytes
    ) -> http.Response:
        await asyncio.sleep(_CATCH_UP_PAUSE)  # a moment for the agent to see the request that ended
        return await self._ask(node_id, url, headers, body)

    async def _ask(
        self, node_id: str, url: http.URL, headers: list[tuple[str, str]], body: bytes
    ) -> http.Response:
        upstream = await self.client.send("POST", url, headers, body, self._timeouts)
        self.pool.connected(node_id)
        if upstream.status != 503:
            return upstream
        kind = await _node_full_kind(upstream)
        if kind == "node_full":
            raise _NodeFull
        self._upstream_error(node_id, kind)
        raise _Retry(kind)

    def _first_byte_timeout(self, call: Call, node: NodeDoc) -> float:
        """A stream's first byte comes with its first token, after its prompt is processed; a non-streamed
        answer's with its last. Either waits as long again as the prompt takes on the node (measured, or
        a slow Mac's speed): a cold 30K-token prompt can take minutes on a small Mac."""
        timeout = self.settings.first_byte_timeout if call.stream else self.settings.response_timeout
        return timeout + prefill_seconds(call.ticket.prompt_tokens, [node])

    def _failed_before_first_byte(
        self, call: Call, node_id: str, upstream: http.Response | None, exc: httpx.HTTPError
    ) -> Response:
        http.close(upstream)
        self._upstream_error(node_id, "protocol")
        log.warning("node %s: %s before the first byte", node_id, type(exc).__name__,
                    extra=_ids(node_id, call))
        self.metrics.requests.labels(model=call.model, node=node_id, status="502").inc()
        return call.error(502, "the node failed before answering", "upstream_error")

    def _url(self, node_url: str, path: str, query: bytes) -> http.URL:
        url = self._urls.get((node_url, path, query))
        if url is None:
            if len(self._urls) > 4096:  # nodes and query strings come and go: keep the cache bounded
                self._urls.clear()
            text = node_url.rstrip("/") + path + ("?" + query.decode("latin-1") if query else "")
            url = self._urls[node_url, path, query] = http.url(text)
        return url

    def _upstream_headers(self, call: Call, node: NodeDoc) -> list[tuple[str, str]]:
        drop = _DROP_UPSTREAM | connection_listed(call.headers)
        kept = ((k, v) for k, v in call.headers if k not in drop and not k.startswith(b"x-macpool-"))
        headers = http.as_str(kept)
        headers.append(("x-request-id", call.request_id))
        if call.stream and call.generations == 1:  # else the agent parses the body to count them
            headers.append(_STREAMED)
        if call.session:
            headers.append((SESSION_HEADER, call.session))
        token = self.pool.trust.agent_token(node)  # the node's own when it signs, else the shared one
        if token:
            headers.append((TOKEN_HEADER, token))
        return headers

    def _upstream_error(self, node_id: str, kind: str) -> None:
        self.metrics.upstream_errors.labels(node=node_id, kind=kind).inc()


class Relay(relay.Relay):
    """An agent's answer relayed to the client (macpool/relay.py), with the request's hold: given back when
    the relay ends, the final status and the tokens counted, a stall in either direction cut off after
    ``--idle-timeout``."""

    shutdown_error = (503, "the router is shutting down; retry", "router_shutdown")

    def __init__(
        self,
        forwarder: Forwarder,
        call: Call,
        hold: Hold,
        upstream: http.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
    ) -> None:
        self.forwarder = forwarder
        self.call = call
        self.hold = hold
        self.node_id = hold.node.node_id
        super().__init__(upstream, [], call.dialect.name, first, chunks)
        self.raw_headers = self.downstream_headers()
        self.outcome = str(upstream.status)
        self.done = False  # the stream's last event is relayed: a client may go without waiting for the end
        # the first chunk with an event (a long prefill may send keep-alive comments first): where a stream
        # says its prompt's usage
        self.head = b""
        # the last chunks relayed (references), where every API puts its usage
        self.tail: deque[bytes] = deque(maxlen=_TAIL_CHUNKS)
        self._timer: asyncio.TimerHandle | None = None

    def downstream_headers(self) -> list[tuple[bytes, bytes]]:
        raw = http.raw_headers(self.upstream)
        drop = _DROP_DOWNSTREAM | connection_listed(raw)
        headers = [(k, v) for k, v in raw if k not in drop]
        if self.streaming:
            headers = [(k, v) for k, v in headers if k not in (b"content-type", b"cache-control",
                                                               b"content-length", b"x-accel-buffering")]
            headers += [(b"content-type", b"text/event-stream"), *_SSE_HEADERS]
        headers += [(b"x-request-id", self.call.request_id.encode()),
                    (b"x-macpool-node", self.node_id.encode())]
        return headers

    def relayed(self, chunk: bytes) -> None:
        if not self.head and b"data:" in chunk:
            self.head = chunk
            if isinstance(self.hold, Reserved):
                self.hold.lease.prefill_tokens = 0  # the node has processed the prompt: it answers
        # a client closes the connection once it reads the stream's last event ([DONE], message_stop), often
        # before the node's end of the body reaches the router: that stream was served whole
        self.done = self.streaming and chunk.endswith(self.call.dialect.stream_end)
        self.tail.append(chunk)

    def completed(self) -> None:
        if self.streaming and self.tail and _AGENT_MIDSTREAM in self.tail[-1][-_TAIL:]:
            # the agent ended the stream with its own error event (llama-server failed mid-stream): relayed
            # as is, and counted as the failure it is, not as a 200
            self.failed("midstream")

    def failed(self, kind: str) -> None:
        self.forwarder.metrics.upstream_errors.labels(node=self.node_id, kind=kind).inc()
        log.warning("node %s: %s after the first byte (request %s)", self.node_id, kind, self.call.request_id,
                    extra=_ids(self.node_id, self.call))
        self.outcome = kind
        if kind == "idle_timeout":
            self.forwarder.pool.connect_failed(self.node_id)  # a hung node: stop sending it traffic

    def stopped(self) -> None:
        self.outcome = "router_shutdown"

    def watch(self, guard: Guard) -> None:
        idle = self.forwarder.settings.idle_timeout
        loop = asyncio.get_running_loop()

        def watchdog() -> None:
            # one timer per relay, re-armed only when it fires: the relay loop just stamps its progress
            left = self.progress_at + idle - time.monotonic()
            if left > 0:
                self._timer = loop.call_later(left, watchdog)
            else:
                guard.cancel(self.phase)

        self._timer = loop.call_later(idle, watchdog)

    def unwatch(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    async def after(self, guard: Guard, send: Send) -> None:
        if guard.reason == "client_closed" and not self.done:
            self.outcome = "client_closed"
        elif guard.reason == "read":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.forwarder.settings.idle_timeout):
                    await self.fail(send, "idle_timeout")
        elif guard.reason == "send":
            self.outcome = "client_stalled"  # the response stays incomplete: the server drops it
            log.info("request %s: the client stopped reading; cut off", self.call.request_id,
                     extra=_ids(self.node_id, self.call))

    async def finish(self) -> None:
        await self.hold.give_back(failed=self.outcome in ("midstream", "idle_timeout"))
        metrics, call = self.forwarder.metrics, self.call
        metrics.requests.labels(model=call.model, node=self.node_id, status=self.outcome).inc()
        metrics.duration.observe(time.monotonic() - call.arrived)
        # an answer's usage comes with its last event: a client that leaves as soon as it has it (Codex does)
        # still had the node process every token, so its outcome does not decide
        usage = call.dialect.usage(self.head, b"".join(self.tail))
        if usage is not None:
            metrics.count_usage(call.model, usage)


def _over_context(status: int, document: object) -> int | None:
    """The prompt's tokens, when ``document`` is llama-server's answer that they are over its context."""
    if status != 400 or not isinstance(document, dict):
        return None
    error = document.get("error")
    if not isinstance(error, dict) or error.get("type") != "exceed_context_size_error":
        return None
    prompt = error.get("n_prompt_tokens")
    return prompt if type(prompt) is int and prompt > 0 else 0


def _ids(node_id: str, call: Call) -> dict[str, str]:
    """A log record's fields (in ``--log-format json``): which node, which request (its X-Request-ID)."""
    return {"node": node_id, "request_id": call.request_id}


async def _node_full_kind(upstream: http.Response) -> str:
    """An agent 503 says ``node_full``; any other 503 (llama-server loading, say) is unavailability."""
    reason = upstream.headers.get("x-macpool-reason")
    try:
        code = json.loads(await http.read(upstream)).get("error", {}).get("code")
    except (ValueError, AttributeError):
        code = None
    return "node_full" if "node_full" in (code, reason) else "unavailable"
