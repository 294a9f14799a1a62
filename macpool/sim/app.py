"""The simulator's HTTP surface: llama-server's endpoints and shapes, plus /sim/* for tests and tools."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from macpool.asgi import Guard
from macpool.sim import anthropic, chat, embeddings, infill, light, responses, shapes, tokens
from macpool.sim.engine import Engine, Runner, Task
from macpool.sim.machine import Machine, MemoryState
from macpool.sim.settings import Resolved, SimSettings, build_info

JSON = "application/json; charset=utf-8"
INT32_MAX = 2**31 - 1
_PRESSURE = {
    MemoryState.HEALTHY: "normal",
    MemoryState.NEAR_CEILING: "warning",
    MemoryState.PAGING: "critical",
    MemoryState.COLLAPSED: "critical",
}


class BadRequest(Exception):
    """A request llama-server would answer with 400 (body already shaped)."""

    def __init__(self, body: bytes) -> None:
        super().__init__(body.decode())
        self.body = body


def json_response(body: bytes | Any, status: int = 200) -> Response:
    data = body if isinstance(body, bytes) else shapes.dumps(body)
    return Response(data, status_code=status, media_type=JSON)


def parse_error(raw: bytes, exc: json.JSONDecodeError) -> bytes:
    """An nlohmann::json-like parse error message."""
    if exc.pos >= len(exc.doc.rstrip()):
        detail = "unexpected end of input; expected '[', '{', or a literal"
    else:
        detail = f"{exc.msg.lower()}"
    message = (
        f"[json.exception.parse_error.101] parse error at line {exc.lineno}, column {exc.colno + 1}: "
        f"syntax error while parsing value - {detail}"
    )
    return shapes.error(400, message, "invalid_request_error")


def invalid(message: str) -> BadRequest:
    return BadRequest(shapes.error(400, message, "invalid_request_error"))


def generation_limit(body: dict[str, Any]) -> int:
    """The most tokens to generate (-1: none), read as llama-server reads ``n_predict`` and its aliases."""
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int | float) or (isinstance(value, float) and not math.isfinite(value)):
            raise invalid(f"Field '{key}': {chat.type_error('number', value)}")
        if not -1 <= int(value) <= INT32_MAX:
            bounds = f"Value must be between -1 <= value <= {INT32_MAX}, but got {int(value)}"
            raise invalid(f"Field '{key}': {bounds}")
        return int(value)
    return -1


class LlamaHeaders:
    """Adds llama-server's ``Server`` and CORS headers to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS":  # CORS preflight, answered for every path as llama-server does
            headers = [
                (b"server", b"llama.cpp"), (b"access-control-allow-origin", b""),
                (b"access-control-allow-credentials", b"true"),
                (b"access-control-allow-methods", b"GET, POST"), (b"access-control-allow-headers", b"*"),
                (b"content-length", b"0"),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"server"]
                headers += [(b"server", b"llama.cpp"), (b"access-control-allow-origin", b"")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class TaskFailed(Exception):
    """llama-server failed a task after it started (a ``server_error``, such as running out of KV cells)."""


def error_event(message: str) -> bytes:
    """A failed task's event in a stream: llama-server's error document as one ``data:`` event."""
    return b"data: " + shapes.error(500, message, "server_error") + b"\n\n"


def anthropic_error_event(message: str) -> bytes:
    """The same on ``/v1/messages``: an ``error`` event whose data is the error itself."""
    return shapes.event("error", {"code": 500, "message": message, "type": "server_error"})


class TaskResponse(Response):
    """Serves one task: headers once there is output (as llama-server does), then the body.

    The client is watched for the whole life of the task: a disconnect (while deferred, prefilling or
    generating) cancels the task and frees its slot at once. A task that fails before its first output is
    a 500 JSON answer, streamed or not; one that fails while streaming ends its stream with ``on_error``'s
    event.
    """

    def __init__(
        self, body: AsyncIterator[bytes], stream: bool, on_close: Callable[[], None],
        on_error: Callable[[str], bytes] = error_event,
    ) -> None:
        super().__init__(status_code=200)
        self.parts = body
        self.stream = stream
        self.on_close = on_close
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = Guard(receive)
        try:
            await guard.run(self._serve(send))
        finally:
            guard.finish()
            self.on_close()

    async def _serve(self, send: Send) -> None:
        if not self.stream:
            try:
                body = b"".join([part async for part in self.parts])
            except TaskFailed as exc:
                await self._send_whole(send, 500, shapes.error(500, str(exc), "server_error"))
                return
            await self._send_whole(send, 200, body)
            return
        started = False
        try:
            async for part in self.parts:
                if not started:
                    headers = [(b"x-accel-buffering", b"no"), (b"content-type", b"text/event-stream")]
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    started = True
                await send({"type": "http.response.body", "body": part, "more_body": True})
        except TaskFailed as exc:
            if not started:
                await self._send_whole(send, 500, shapes.error(500, str(exc), "server_error"))
                return
            await send({"type": "http.response.body", "body": self.on_error(str(exc)), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _send_whole(send: Send, status: int, body: bytes) -> None:
        headers = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


NULL_EVENT, DONE = b"data: null\n\n", b"data: [DONE]\n\n"
Render = Callable[[int, Task, int, int], list[bytes]]  # (index, task, first, last token) -> the events


def sse(obj: Any) -> bytes:
    return b"data: " + shapes.dumps(obj) + b"\n\n"


async def progress(task: Task, runner: Runner | None = None) -> AsyncGenerator[tuple[int, int], None]:
    """Yields ``(first, last)`` token ranges as the engine produces them, until the task ends; raises
    :class:`TaskFailed` once the tokens it had are out, if the engine failed it.

    With ``runner`` (streaming), each range is reported as sent once the consumer has written it.
    """
    assert task.wake is not None
    sent = 0
    while True:
        await task.wake.wait()
        task.wake.clear()
        if task.n_decoded > sent or task.answered:
            hi = task.n_decoded
            task.writing = True
            try:
                yield sent, hi
            finally:
                task.writing = False
            sent = hi
            if runner is not None:
                runner.sent(task, sent)
        if task.error:
            raise TaskFailed(task.error)
        if task.finished:
            return


class SimServer:
    """One simulated Mac: the machine, the engine and its runner, and the HTTP handlers."""

    def __init__(self, settings: SimSettings, machine: Machine) -> None:
        self.settings = settings
        self.machine = machine
        self.resolved = Resolved(settings, machine)
        r = self.resolved
        machine.check_start(r.n_cells, r.model_path)
        self.engine = Engine(machine, r.n_slots, r.n_ctx_slot, r.options)
        self.runner = Runner(self.engine, settings.speed)
        self.started = time.monotonic()
        self.fingerprint = build_info()

    # --- lifecycle ----------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        loop_task = asyncio.create_task(self.runner.run(), name="sim-engine")
        try:
            yield
        finally:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task

    def loading(self) -> bool:
        return time.monotonic() - self.started < self.settings.load_seconds

    # --- routes -------------------------------------------------------------------------------------------
    def routes(self) -> list[Route]:
        r = self.guard
        return [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/slots", r(self.slots), methods=["GET"]),
            Route("/metrics", r(self.metrics), methods=["GET"]),
            Route("/props", r(self.props), methods=["GET"]),
            Route("/models", r(self.models), methods=["GET"]),
            Route("/v1/models", r(self.models), methods=["GET"]),
            Route("/v1/chat/completions", r(self.chat), methods=["POST"]),
            Route("/chat/completions", r(self.chat), methods=["POST"]),
            Route("/v1/completions", r(self.completions), methods=["POST"]),
            Route("/completion", r(self.native), methods=["POST"]),
            Route("/completions", r(self.native), methods=["POST"]),
            Route("/infill", r(self.infill), methods=["POST"]),
            Route("/v1/messages", r(self.anthropic_messages), methods=["POST"]),
            Route("/v1/responses", r(self.responses_oai), methods=["POST"]),
            Route("/responses", r(self.responses_oai), methods=["POST"]),
            Route("/v1/embeddings", r(self.embeddings_oai), methods=["POST"]),
            Route("/embeddings", r(self.embeddings), methods=["POST"]),
            Route("/embedding", r(self.embeddings), methods=["POST"]),
            *(Route(path, r(self.rerank), methods=["POST"])
              for path in ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking")),
            *(Route(path, r(self.light(answer)), methods=["POST"]) for path, answer in light.ANSWERS.items()),
            Route("/sim/memory", self.sim_memory, methods=["GET"]),
            Route("/sim/stats", self.sim_stats, methods=["GET"]),
            Route("/sim/reset", self.sim_reset, methods=["POST"]),
            Route("/sim/pressure", self.sim_pressure, methods=["POST"]),
        ]

    def guard(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """llama-server answers every model endpoint with 503 while loading, and 400 for bad bodies."""

        async def guarded(request: Request) -> Response:
            if self.loading():
                return self.loading_response()
            try:
                return await handler(request)
            except BadRequest as exc:
                return json_response(exc.body, 400)
            except chat.RequestError as exc:
                return json_response(shapes.error(exc.status, exc.message, exc.type), exc.status)
            except tokens.PromptError as exc:
                return json_response(invalid(str(exc)).body, 400)

        return guarded

    @staticmethod
    def loading_response() -> Response:
        return json_response(shapes.error_mtc(503, "Loading model", "unavailable_error"), 503)

    async def health(self, request: Request) -> Response:
        if self.loading():
            return self.loading_response()
        return json_response({"status": "ok"})

    async def slots(self, request: Request) -> Response:
        fail = request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false")
        if fail and all(s.task is not None for s in self.engine.slots):
            return json_response(shapes.error(503, "no slot available", "unavailable_error"), 503)
        return json_response([self.slot_json(i) for i in range(len(self.engine.slots))])

    def slot_json(self, index: int) -> dict[str, Any]:
        slot = self.engine.slots[index]
        out: dict[str, Any] = {"id": slot.id, "n_ctx": slot.n_ctx, "speculative": False}
        task = slot.task
        out["is_processing"] = task is not None
        if task is None:
            return out
        limit = task.n_predict if task.finish_on_limit == "length" else -1
        out.update(
            id_task=task.id,
            n_prompt_tokens=task.n_past + task.n_decoded,  # what the slot holds: none for a waiting child
            n_prompt_tokens_processed=task.n_past - task.n_cache,
            n_prompt_tokens_cache=task.n_cache,
            params=shapes.slot_params(limit, False, True),
            next_token=[{
                "has_next_token": True, "has_new_line": False,
                "n_remain": max(-1, task.n_predict - task.n_decoded) if limit >= 0 else -1,
                "n_decoded": task.n_decoded,
            }],
        )
        return out

    async def metrics(self, request: Request) -> Response:
        if not self.settings.metrics:
            message = "This server does not support metrics endpoint. Start it with `--metrics`"
            return json_response(shapes.error(501, message, "not_supported_error"), 501)
        c = self.engine.counters
        # seconds of /metrics' clock per simulated second
        clock = 1 / self.runner.speed if self.settings.metrics_clock == "wall" else 1.0
        prompt_s, predicted_s = c.bucket_prompt_seconds * clock, c.bucket_predicted_seconds * clock
        prompt_rate = c.bucket_prompt_tokens / prompt_s if prompt_s else 0.0
        predicted_rate = c.bucket_predicted_tokens / predicted_s if predicted_s else 0.0
        c.bucket_prompt_tokens = c.bucket_predicted_tokens = 0
        c.bucket_prompt_seconds = c.bucket_predicted_seconds = 0.0
        busy_per_decode = c.n_busy_slots_total / c.n_decode_total if c.n_decode_total else 0.0
        rows: list[tuple[str, str, str, float]] = [
            ("counter", "prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
             c.prompt_tokens_total),
            ("counter", "prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
             c.prompt_tokens_cached_total),
            ("counter", "prompt_seconds_total", "Total time spent processing prompts",
             c.prompt_seconds_total * clock),
            ("counter", "tokens_predicted_total", "Number of generation tokens processed",
             c.tokens_predicted_total),
            ("counter", "tokens_predicted_seconds_total", "Total time spent generating tokens",
             c.tokens_predicted_seconds_total * clock),
            ("counter", "n_decode_total",
             "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
             c.n_decode_total),
            ("counter", "n_tokens_max", "Largest observed sequence length (prompt + generation)",
             c.n_tokens_max),
            ("counter", "spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
            ("counter", "spec_decode_num_accepted_tokens_total",
             "Speculative: Total draft tokens accepted by the target model", 0),
            ("counter", "spec_decode_num_drafts_total",
             "Speculative: Total speculative decoding verification steps", 0),
            ("gauge", "prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
            ("gauge", "predicted_tokens_seconds", "Average generation throughput in tokens/s",
             predicted_rate),
            ("gauge", "requests_processing", "Number of requests processing", len(self.engine.running)),
            ("gauge", "requests_deferred", "Number of requests deferred", len(self.engine.deferred)),
            ("gauge", "n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
             busy_per_decode),
        ]
        lines = []
        for kind, name, help_, value in rows:
            lines += [f"# HELP llamacpp:{name} {help_}", f"# TYPE llamacpp:{name} {kind}"]
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            lines.append(f"llamacpp:{name} {shown}")
        headers = {"Process-Start-Time-Unix": str(int(time.time() - (time.monotonic() - self.started)))}
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4", headers=headers)

    async def props(self, request: Request) -> Response:
        r = self.resolved
        return json_response({
            "default_generation_settings": {"params": shapes.SLOT_PARAMS, "n_ctx": r.n_ctx_slot},
            "total_slots": r.n_slots,
            "model_alias": r.model_name,
            "model_ftype": "Q4_K - Medium",
            "model_path": r.model_path,
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": "<__media_macpoolsim__>",
            "endpoint_slots": True,
            "endpoint_props": False,
            "endpoint_metrics": self.settings.metrics,
            "ui": False,
            "ui_settings": {},
            "chat_template": tokens.CHAT_TEMPLATE,
            "chat_template_caps": {
                "supports_object_arguments": False, "supports_parallel_tool_calls": False,
                "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
                "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": False,
                "supports_tools": False, "supports_typed_content": False,
            },
            "bos_token": "<s>",
            "eos_token": "</s>",
            "build_info": self.fingerprint,
            "is_sleeping": False,
            "cors_proxy_enabled": False,
        })

    async def models(self, request: Request) -> Response:
        name = self.resolved.model_name
        return json_response({
            "models": [{
                "name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
                "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                "details": {
                    "parent_model": "", "format": "gguf", "family": "", "families": [""],
                    "parameter_size": "", "quantization_level": "",
                },
            }],
            "object": "list",
            "data": [{
                "id": name, "aliases": [name], "tags": [], "object": "model",
                "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                "created": int(time.time()), "owned_by": "llamacpp", "meta": self.model_meta(),
            }],
        })

    def model_meta(self) -> dict[str, Any]:
        """The model's ``meta`` in /v1/models (llama-server reads it from the GGUF)."""
        return {
            "vocab_type": 2, "n_vocab": 151936, "n_ctx": self.resolved.n_ctx_slot,
            "n_ctx_train": self.machine.n_ctx_train, "n_embd": 5120, "n_params": 14_000_000_000,
            "size": int(self.machine.weights_gb * 2**30), "ftype": "Q4_K - Medium",
        }

    # --- generation ---------------------------------------------------------------------------------------
    @staticmethod
    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise BadRequest(parse_error(raw, exc)) from exc
        except UnicodeDecodeError as exc:
            raise invalid("request body is not UTF-8") from exc
        if not isinstance(data, dict):
            raise invalid("request body must be a JSON object")
        return data

    def check_fits(self, n_prompt: int) -> None:
        n_ctx = self.resolved.n_ctx_slot
        if n_prompt >= n_ctx:  # llama-server keeps room for at least one more token
            message = f"request ({n_prompt} tokens) exceeds the available context size ({n_ctx} tokens), " \
                "try increasing it"
            raise BadRequest(shapes.error(
                400, message, "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=n_ctx,
            ))

    def new_task(self, body: dict[str, Any], prompt: str) -> Task:
        """One generation's task, checked (BadRequest) but not submitted."""
        task = self._new_task(body, prompt)
        task.id_slot = named_slot(body)
        return task

    def _new_task(self, body: dict[str, Any], prompt: str) -> Task:
        n_prompt = tokens.count(prompt)
        n_ctx = self.resolved.n_ctx_slot
        self.check_fits(n_prompt)
        if n_prompt == 0:
            raise invalid("the prompt is empty")
        limit = generation_limit(body)
        if limit == 0:
            limit = 1  # llama-server still evaluates one token
        if limit > 0:
            return Task(prompt=prompt, n_prompt=n_prompt, n_predict=limit)
        if body.get("ignore_eos") is True:
            return Task(prompt=prompt, n_prompt=n_prompt, n_predict=n_ctx)  # until the context is full
        return Task(prompt, n_prompt, self.machine.default_n_predict, finish_on_limit="stop")

    def new_tasks(self, body: dict[str, Any], prompts: list[str]) -> list[Task]:
        """Every generation of a request, submitted: each prompt ``n`` times (llama-server's ``n_cmpl``, or
        its alias ``n``), in the order of their ``index``; each takes a slot of its own, and a prompt's ``n``
        start together."""
        # as llama-server reads them: n_cmpl, else n (null: absent), a number taken as an integer (2.5 runs 2,
        # true 1), checked once it is one
        name = "n_cmpl" if body.get("n_cmpl") is not None else "n"
        value = body.get(name)
        if value is None:
            value = 1
        if not isinstance(value, int | float) or (isinstance(value, float) and not math.isfinite(value)):
            raise invalid(f"Field '{name}': {chat.type_error('number', value)}")
        n, slots = int(value), self.resolved.n_slots
        if not 1 <= n <= slots:  # llama-server's limit: the children of a task run in slots of their own
            raise invalid(f"Field '{name}': Value must be between 1 <= value <= {slots}, but got {n}")
        groups = [[self.new_task(body, prompt) for _ in range(n)] for prompt in prompts]
        for group in groups:
            self.runner.submit(*group)
        return [task for group in groups for task in group]

    def pooled_tasks(self, prompts: list[str]) -> list[Task]:
        """An embeddings or rerank request's tasks, submitted: one per prompt, each in a slot of its own
        (an empty text still costs the one token it is to llama-server, its BOS)."""
        tasks = [Task(prompt, max(1, tokens.count(prompt)), 0, pooled=True) for prompt in prompts]
        for task in tasks:
            self.check_fits(task.n_prompt)
        for task in tasks:
            self.runner.submit(task)
        return tasks

    @staticmethod
    def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
        options = body.get("stream_options")
        include = isinstance(options, dict) and options.get("include_usage") is True
        return body.get("stream") is True, include

    def respond(
        self, tasks: list[Task], parts: AsyncIterator[bytes], stream: bool,
        on_error: Callable[[str], bytes] = error_event,
    ) -> Response:
        def close() -> None:
            for task in tasks:
                self.runner.cancel(task)

        return TaskResponse(parts, stream, on_close=close, on_error=on_error)

    def streamed(
        self, tasks: list[Task], render: Render, head: bytes = b"", tail: bytes = b""
    ) -> AsyncIterator[bytes]:
        """One stream of every generation's events (``render(index, task, first, last)``), as each has new
        tokens: interleaved, as llama-server sends them; ``tail`` after the last."""
        if len(tasks) == 1:
            return self._one_stream(tasks[0], render, tail)
        return self._merged_stream(tasks, render, head, tail)

    async def _one_stream(self, task: Task, render: Render, tail: bytes) -> AsyncIterator[bytes]:
        async for lo, hi in progress(task, self.runner):
            yield b"".join(render(0, task, lo, hi)) + (tail if task.answered else b"")

    async def _merged_stream(
        self, tasks: list[Task], render: Render, head: bytes, tail: bytes
    ) -> AsyncIterator[bytes]:
        if head:
            yield head
        streams = [progress(task, self.runner) for task in tasks]
        waiting = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index = waiting.pop(future)
                    try:
                        lo, hi = future.result()
                    except StopAsyncIteration:
                        continue
                    yield b"".join(render(index, tasks[index], lo, hi))
                    waiting[asyncio.ensure_future(anext(streams[index]))] = index
            yield tail
        finally:
            for future in waiting:
                if not future.done():
                    future.cancel()
                elif not future.cancelled():
                    future.exception()  # read (a finished generation's StopAsyncIteration): nothing to log
            for stream in streams:
                with contextlib.suppress(RuntimeError):  # one still running its cancelled step
                    await stream.aclose()

    @staticmethod
    async def finished(tasks: list[Task]) -> None:
        for task in tasks:
            async for _ in progress(task):
                pass

    async def chat(self, request: Request) -> Response:
        body = await self.body(request)
        prompt = chat.prompt(body)
        stream, include_usage = self.stream_flags(body)
        shaper = shapes.Shaper(self.resolved.model_name, self.fingerprint, include_usage)
        tasks = self.new_tasks(body, [prompt])

        def render(index: int, task: Task, lo: int, hi: int) -> list[bytes]:
            out = [sse(shaper.chat_role_chunk(index))] if lo == 0 and include_usage else []
            out += [sse(shaper.chat_content_chunk(tokens.piece(k), index)) for k in range(lo, hi)]
            if task.answered:
                out += [sse(chunk) for chunk in shaper.chat_final_chunks(task, index)]
            return out

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            answers = [(task, tokens.filler(task.n_decoded)) for task in tasks]
            yield shapes.dumps(shaper.chat_response(*answers[0], more=answers[1:]))

        return self.respond(tasks, self.streamed(tasks, render, tail=DONE) if stream else whole(), stream)

    async def completions(self, request: Request) -> Response:
        body = await self.body(request)
        prompts = tokens.prompt_texts(body.get("prompt"))
        stream, _ = self.stream_flags(body)
        shaper = shapes.Shaper(self.resolved.model_name, self.fingerprint)
        tasks = self.new_tasks(body, prompts)

        def render(index: int, task: Task, lo: int, hi: int) -> list[bytes]:
            out = [sse(shaper.text_chunk(tokens.piece(k), index)) for k in range(lo, hi)]
            if task.answered:
                out.append(sse(shaper.text_final_chunk(task, index)))
            return out

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            answers = [(task, tokens.filler(task.n_decoded)) for task in tasks]
            yield shapes.dumps(shaper.text_response(*answers[0], more=answers[1:]))

        # several prompts: llama-server's stream opens with "data: null"
        head = NULL_EVENT if len(prompts) > 1 else b""
        return self.respond(tasks, self.streamed(tasks, render, head, DONE) if stream else whole(), stream)

    async def native(self, request: Request) -> Response:
        body = await self.body(request)
        return self.native_answer(body, tokens.prompt_texts(body.get("prompt")))

    async def infill(self, request: Request) -> Response:
        body = await self.body(request)
        prompt = infill.prompt(body, self.machine.n_batch, self.resolved.n_ctx_slot)
        return self.native_answer(body, [prompt])

    def native_answer(self, body: dict[str, Any], prompts: list[str]) -> Response:
        """llama.cpp's own completion document (/completion, /infill) for each prompt."""
        stream, _ = self.stream_flags(body)
        ignore_eos = body.get("ignore_eos") is True
        shaper = shapes.Shaper(self.resolved.model_name, self.fingerprint)
        tasks = self.new_tasks(body, prompts)
        n = len(tasks) // len(prompts)

        def final(index: int, text: str) -> dict[str, Any]:
            task = tasks[index]
            limit = task.n_predict if task.finish_on_limit == "length" else -1
            return shaper.native_final(task, text, prompts[index // n], limit, ignore_eos, stream, index)

        def render(index: int, task: Task, lo: int, hi: int) -> list[bytes]:
            out = []
            for k in range(lo, hi):
                chunk = shaper.native_chunk(tokens.piece(k), tokens.token_id(k), task, index)
                chunk["tokens_predicted"] = k + 1
                out.append(sse(chunk))
            if task.answered:
                out.append(sse(final(index, "")))
            return out

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            answers = [final(index, tokens.filler(task.n_decoded)) for index, task in enumerate(tasks)]
            # several generations: a JSON array of the answers, in index order
            yield shapes.dumps(answers[0] if len(answers) == 1 else answers)

        head = NULL_EVENT if len(prompts) > 1 else b""
        return self.respond(tasks, self.streamed(tasks, render, head) if stream else whole(), stream)

    async def anthropic_messages(self, request: Request) -> Response:
        converted = anthropic.to_chat(await self.body(request))
        prompt = chat.prompt(converted)
        stream = converted.get("stream") is True
        shaper = anthropic.MessagesShaper(self.resolved.model_name)
        tasks = self.new_tasks(converted, [prompt])  # one: the conversion leaves out n

        def render(index: int, task: Task, lo: int, hi: int) -> list[bytes]:
            out = shaper.start(task) if lo == 0 < hi else []
            out += [shaper.delta(tokens.piece(k)) for k in range(lo, hi)]
            return out + shaper.stop(task) if task.answered else out

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            yield shapes.dumps(shaper.answer(tasks[0], tokens.filler(tasks[0].n_decoded)))

        parts = self.streamed(tasks, render) if stream else whole()
        return self.respond(tasks, parts, stream, on_error=anthropic_error_event)

    async def responses_oai(self, request: Request) -> Response:
        converted = responses.to_chat(await self.body(request))
        prompt = chat.prompt(converted)
        stream = converted.get("stream") is True
        shaper = responses.ResponsesShaper(self.resolved.model_name)
        tasks = self.new_tasks(converted, [prompt])

        def render(index: int, task: Task, lo: int, hi: int) -> list[bytes]:
            out = shaper.start(index) if lo == 0 < hi else []
            out += [shaper.delta(tokens.piece(k), index) for k in range(lo, hi)]
            return out + shaper.stop(task, index) if task.answered else out

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            answers = [shaper.answer(t, tokens.filler(t.n_decoded), i) for i, t in enumerate(tasks)]
            yield shapes.dumps(answers[0] if len(answers) == 1 else answers)  # n > 1: an array

        return self.respond(tasks, self.streamed(tasks, render) if stream else whole(), stream)

    async def embeddings_oai(self, request: Request) -> Response:
        return await self.embed(request, oai=True)

    async def embeddings(self, request: Request) -> Response:
        return await self.embed(request, oai=False)

    async def embed(self, request: Request, oai: bool) -> Response:
        body = await self.body(request)
        asked = embeddings.embedding_request(body, oai)
        tasks = self.pooled_tasks(asked.texts)
        model = embeddings.model_name(body, self.resolved.model_name)

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            yield shapes.dumps(embeddings.embedding_answer(asked, model, [t.n_prompt for t in tasks]))

        return self.respond(tasks, whole(), stream=False)

    async def rerank(self, request: Request) -> Response:
        body = await self.body(request)
        asked = embeddings.rerank_request(body)
        tasks = self.pooled_tasks(asked.prompts())
        model = embeddings.model_name(body, self.resolved.model_name)

        async def whole() -> AsyncIterator[bytes]:
            await self.finished(tasks)
            yield shapes.dumps(embeddings.rerank_answer(asked, model, [t.n_prompt for t in tasks]))

        return self.respond(tasks, whole(), stream=False)

    def light(self, answer: light.Answer) -> Callable[[Request], Awaitable[Response]]:
        """A light endpoint: answered from the tokenizer and the template at once, no slot."""

        async def handler(request: Request) -> Response:
            return json_response(answer(await self.body(request)))

        return handler

    # --- /sim -------------------------------------------------------------------------------------------
    def memory_json(self) -> dict[str, Any]:
        m = self.machine
        pinned = self.engine.pinned_gb()
        state = m.state(pinned)
        cache = self.engine.prompt_cache
        return {
            "total_gb": m.total_gb,
            "wired_limit_gb": m.wired_limit_gb,
            "weights_gb": m.weights_gb,
            "pinned_gb": round(pinned, 3),
            "per_request_gb": round(self.per_request_gb(), 3),
            "kv_cache_gb": round(self.engine.kv_cache_gb, 3),
            "kv_unified": self.resolved.kv_unified,
            "kv_cells": self.engine.n_cells,
            "kv_cells_used": self.engine.cells_used(),
            "prompt_cache_gb": round(cache.size_bytes() / 2**30, 3) if cache is not None else 0.0,
            "state": state.value,
            "external_gb": self.engine.external_gb,
            "swap_used_gb": round(max(0.0, pinned - m.wired_limit_gb), 3),
            "pressure": _PRESSURE[state],
        }

    def per_request_gb(self) -> float:
        """With the KV cache allocated at start, a slot's share of it (what an agent estimates from the GGUF
        on a real Mac); else the working set one more typical request adds."""
        m, r = self.machine, self.resolved
        return r.n_cells / r.n_slots * m.kv_mb_per_token / 1024 if m.kv_at_start else m.per_request_gb()

    async def sim_memory(self, request: Request) -> Response:
        return json_response(self.memory_json())

    async def sim_stats(self, request: Request) -> Response:
        c = self.engine.counters
        return json_response({
            "processing": len(self.engine.running),
            "deferred": len(self.engine.deferred),
            "max_concurrent": c.max_concurrent,
            "completed": c.completed,
            "cancelled": c.cancelled,
            "failed": c.failed,
            "prompt_cache_restores": c.prompt_cache_restores,
            "speed": self.runner.speed,
            "sim_time_s": round(self.runner.sim_now(), 6),
            "busy_time_s": round(c.busy_s, 6),
            "tokens_predicted_total": c.tokens_generated,
            "prompt_tokens_total": c.prompt_tokens_total,
            "prompt_tokens_cached_total": c.prompt_tokens_cached_total,
            "peak_pinned_gb": round(c.peak_pinned_gb, 3),
            "worst_state": c.worst_state,
        })

    async def sim_reset(self, request: Request) -> Response:
        self.engine.reset_stats()
        return await self.sim_stats(request)

    async def sim_pressure(self, request: Request) -> Response:
        try:
            body = await self.body(request)
        except BadRequest as exc:
            return json_response(exc.body, 400)
        value = body.get("external_gb")
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0 or math.isnan(value):
            return json_response(invalid("'external_gb' must be a number >= 0").body, 400)
        self.engine.external_gb = float(value)
        return json_response(self.memory_json())


async def not_found(request: Request, exc: Exception) -> Response:
    return json_response(shapes.error_mtc(404, "File Not Found", "not_found_error"), 404)


async def not_allowed(request: Request, exc: Exception) -> Response:
    return json_response(shapes.error_mtc(405, "Method Not Allowed", "invalid_request_error"), 405)


async def server_error(request: Request, exc: Exception) -> Response:
    return json_response(shapes.error(500, f"internal error: {type(exc).__name__}", "server_error"), 500)


async def http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        return await not_found(request, exc)
    if status == 405:
        return await not_allowed(request, exc)
    detail = str(getattr(exc, "detail", ""))
    return json_response(shapes.error_mtc(status, detail, "invalid_request_error"), status)


def create_app(settings: SimSettings, machine: Machine | None = None) -> ASGIApp:
    """The simulator app for ``settings`` (the machine is loaded from them unless given)."""
    server = SimServer(settings, machine or settings.load_machine())
    app = Starlette(
        routes=server.routes(),
        lifespan=server.lifespan,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    return LlamaHeaders(app)


def named_slot(body: dict[str, Any]) -> int:
    """The slot a body names (``id_slot``, as llama-server's json_value reads it: a number taken as an
    integer; anything else, or none, -1: any slot; a negative one finds no slot there either)."""
    value = body.get("id_slot")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return -1
    return max(-1, int(value))
