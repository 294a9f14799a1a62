"""A stand-in llama-server that echoes the request headers it received and answers with hostile headers.

``python -m tests.reliability.echo_upstream --port P``. Enough of llama-server's surface for an agent to go
ready (/health, /props, /v1/models, /metrics); generation endpoints answer
``{"headers": [[k, v], ...], "body": "<the request body>"}``.
"""

from __future__ import annotations

import argparse
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

# what a misbehaving upstream might send back: hop-by-hop headers, one named by Connection, a forged reason
HOSTILE = {
    "keep-alive": "timeout=999",
    "proxy-authenticate": "Basic realm=upstream",
    "upgrade": "h2c",
    "trailer": "X-Trailer",
    "x-hop-upstream": "private-hop",
    "connection": "x-hop-upstream",
    "x-upstream-kept": "yes",
}


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    return JSONResponse(
        {"total_slots": 4, "default_generation_settings": {"n_ctx": 1024}, "build_info": "echo"}
    )


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "echo", "object": "model"}]})


async def metrics(request: Request) -> Response:
    return PlainTextResponse("")


async def echo(request: Request) -> Response:
    body = (await request.body()).decode()
    received = {"headers": [[k, v] for k, v in request.headers.items()], "body": body}
    return JSONResponse(received, headers=HOSTILE)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    routes = [
        Route("/health", health),
        Route("/props", props),
        Route("/v1/models", models),
        Route("/metrics", metrics),
    ]
    routes += [
        Route(path, echo, methods=["POST"])
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/completion")
    ]
    uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
