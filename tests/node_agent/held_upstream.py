"""A stand-in llama-server that answers every path of ``macpool/apis.py`` only when told to: ``app()`` (a
fresh one per call) from tests.stand_in, or ``python -m tests.node_agent.held_upstream --port P``.

Enough of llama-server's surface for an agent to go ready (4 slots), plus every generation and light path.
A request waits at the stand-in until ``POST /held/release`` (then it, and every later one, is answered);
a streamed one first sends its first events at once, as llama-server sends its head with the first token,
and the rest after the release. The answers have llama-server's shapes, in the path's dialect; a Responses
answer's text is ``max_output_tokens`` characters long. ``GET /held`` says what came and what is waiting:
``{"arrived": {path: n}, "streamed": {path: n}, "waiting": n, "cancelled": n}`` - ``cancelled`` counts the
streams whose client (the agent) went away before their end, as llama-server cancels their task.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from macpool.apis import APIS
from tests import stand_in

MODEL = "held"
Events = list[tuple[str | None, dict[str, Any]]]  # (event name, data) pairs


class Held:
    """What came, what waits, and the release every request waits for."""

    def __init__(self) -> None:
        self.arrived: Counter[str] = Counter()
        self.streamed: Counter[str] = Counter()
        self.waiting = 0
        self.cancelled = 0
        self.released = asyncio.Event()

    async def wait(self) -> None:
        self.waiting += 1
        try:
            await self.released.wait()
        finally:
            self.waiting -= 1


def _sse(events: Events) -> bytes:
    return b"".join((f"event: {name}\n".encode() if name else b"") + b"data: " + json.dumps(data).encode()
                    + b"\n\n" for name, data in events)


def _messages(request: dict[str, Any]) -> tuple[Events, Events, dict[str, Any]]:
    usage = {"cache_read_input_tokens": 0, "input_tokens": 3, "output_tokens": 1}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL,
               "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    ending = {"stop_reason": "max_tokens", "stop_sequence": None}
    first: Events = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "a"}}),
    ]
    rest: Events = [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": ending, "usage": {"output_tokens": 1}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    whole = {**message, "content": [{"type": "text", "text": "a"}], **ending, "usage": usage}
    return first, rest, whole


def _responses(request: dict[str, Any]) -> tuple[Events, Events, dict[str, Any]]:
    text = "a" * int(request.get("max_output_tokens") or 1)
    part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
    item = {"type": "message", "status": "completed", "id": "msg_1", "content": [part], "role": "assistant"}
    usage = {"input_tokens": 3, "output_tokens": len(text), "total_tokens": 3 + len(text),
             "input_tokens_details": {"cached_tokens": 0}}
    response = {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": MODEL,
                "output": [item], "usage": usage}
    started = {"id": "resp_1", "object": "response", "status": "in_progress"}
    first: Events = [
        ("response.created", {"type": "response.created", "response": started}),
        ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1",
                                        "delta": text}),
    ]
    rest: Events = [("response.completed", {"type": "response.completed", "response": response})]
    whole = {"completed_at": 1, "created_at": 1, "id": "resp_1", "model": MODEL, "object": "response",
             "output": [{"content": [part], "id": "msg_1", "role": "assistant", "status": "completed",
                         "type": "message"}], "status": "completed", "usage": usage}
    return first, rest, whole


def _chat(request: dict[str, Any]) -> tuple[Events, Events, dict[str, Any]]:
    head = {"created": 1, "model": MODEL, "system_fingerprint": "held", "id": "chatcmpl-1"}
    usage = {"completion_tokens": 1, "prompt_tokens": 3, "total_tokens": 4}
    chunk = {**head, "object": "chat.completion.chunk"}
    first: Events = [
        (None, {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant",
                                                                          "content": None}}], **chunk}),
        (None, {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "a"}}], **chunk}),
    ]
    rest: Events = [
        (None, {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **chunk}),
        (None, {"choices": [], **chunk, "usage": usage}),
    ]
    message = {"role": "assistant", "content": "a"}
    whole = {"choices": [{"finish_reason": "length", "index": 0, "message": message}], **head,
             "object": "chat.completion", "usage": usage}
    return first, rest, whole


def _completions(request: dict[str, Any]) -> tuple[Events, Events, dict[str, Any]]:
    head = {"created": 1, "model": MODEL, "system_fingerprint": "held", "id": "cmpl-1"}
    usage = {"completion_tokens": 1, "prompt_tokens": 3, "total_tokens": 4}
    def choice(text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}

    first: Events = [(None, {"choices": [choice("a", None)], **head, "object": "text_completion"})]
    rest: Events = [(None, {"choices": [choice("", "length")], **head, "object": "text_completion",
                            "usage": usage})]
    whole = {"choices": [choice("a", "length")], **head, "object": "text_completion", "usage": usage}
    return first, rest, whole


def _native(request: dict[str, Any]) -> tuple[Events, Events, dict[str, Any]]:
    last = {"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "model": MODEL,
            "tokens_predicted": 1, "tokens_evaluated": 3, "stop_type": "limit"}
    first: Events = [(None, {"index": 0, "content": "a", "tokens": [], "stop": False, "id_slot": 0,
                             "tokens_predicted": 1, "tokens_evaluated": 3})]
    return first, [(None, last)], {**last, "content": "a"}


STREAMS = {"messages": _messages, "responses": _responses, "chat": _chat, "completions": _completions,
           "completion": _native, "infill": _native}
ANSWERS: dict[str, dict[str, Any]] = {  # the other dialects' answers: never streamed
    "embeddings": {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                   "model": MODEL, "usage": {"prompt_tokens": 1, "total_tokens": 1}},
    "rerank": {"model": MODEL, "object": "list", "usage": {"prompt_tokens": 2, "total_tokens": 2},
               "results": [{"index": 0, "relevance_score": 0.5}]},
    "tokenize": {"tokens": [1, 2]},
}


def routes() -> list[Route]:
    """Every path of ``macpool/apis.py``, and ``/held``, over one fresh ``Held``."""
    held = Held()

    async def answer(request: Request) -> Response:
        path: str = request.url.path
        body = json.loads(await request.body() or b"{}")
        held.arrived[path] += 1
        api = APIS[path]
        if api.light:
            await held.wait()
            return JSONResponse({"input_tokens": 3} if api.dialect != "tokenize" else ANSWERS["tokenize"])
        shapes = STREAMS.get(api.dialect)
        if shapes is None:
            await held.wait()
            return JSONResponse(ANSWERS[api.dialect])
        first, rest, whole = shapes(body)
        if not body.get("stream"):
            await held.wait()
            return JSONResponse(whole)
        held.streamed[path] += 1
        done = b"data: [DONE]\n\n" if api.dialect in ("chat", "completions") else b""

        async def events() -> AsyncIterator[bytes]:
            ended = False
            try:
                yield _sse(first)
                await held.wait()
                yield _sse(rest) + done
                ended = True
            finally:
                if not ended:
                    held.cancelled += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    async def state(request: Request) -> Response:
        return JSONResponse({"arrived": held.arrived, "streamed": held.streamed, "waiting": held.waiting,
                             "cancelled": held.cancelled})

    async def release(request: Request) -> Response:
        held.released.set()
        return JSONResponse({"released": True})

    paths = [Route(path, answer, methods=["POST"]) for path in APIS]
    return [*paths, Route("/held", state), Route("/held/release", release, methods=["POST"])]


def app() -> Starlette:
    """A fresh held stand-in."""
    return stand_in.app(MODEL, routes())


def main(argv: list[str]) -> int:
    return stand_in.serve(argv, MODEL, routes(), log_level="critical")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
