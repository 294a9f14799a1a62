"""A stand-in llama-server whose streams fail: ``python -m tests.node_agent.failing_upstream --port P``.

Enough of llama-server's surface for an agent to go ready. ``POST /v1/chat/completions`` answers 200 with
an event stream that carries llama-server's error event when the prompt says ``error``, and otherwise one
event and then a cut connection.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
ERROR = b'data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}\n\n'


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    return JSONResponse({"total_slots": 4, "default_generation_settings": {"n_ctx": 1024}, "build_info": "x"})


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "failing", "object": "model"}]})


async def metrics(request: Request) -> Response:
    return PlainTextResponse("")


async def chat(request: Request) -> Response:
    asks_error = "error" in json.dumps(json.loads(await request.body()).get("messages"))

    async def events() -> AsyncIterator[bytes]:
        yield ERROR if asks_error else EVENT
        if not asks_error:
            raise RuntimeError("cut off mid-stream")  # uvicorn drops the connection

    return StreamingResponse(events(), media_type="text/event-stream")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    routes = [
        Route("/health", health),
        Route("/props", props),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=args.port, log_level="critical")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
