"""The part of llama-server's surface an agent needs to go ready, for stand-in upstreams in tests.

``app(name, routes)`` answers ``/health``, ``/props`` (4 slots of 1,024 tokens), ``/v1/models`` (one
model, ``name``) and an empty ``/metrics``, plus the stand-in's own ``routes``. ``serve(argv, name, routes)``
serves it as a process on ``--port`` from ``argv``; an idle connection is closed after ``keep_alive_s``
(uvicorn's default, 5 s, as llama-server's).
"""

from __future__ import annotations

import argparse

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route


def app(name: str, routes: list[Route]) -> Starlette:
    """The stand-in's application: the surface above, plus its own ``routes``."""

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def props(request: Request) -> Response:
        settings = {"n_ctx": 1024}
        return JSONResponse({"total_slots": 4, "default_generation_settings": settings, "build_info": name})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse("")

    surface = [Route("/health", health), Route("/props", props), Route("/v1/models", models),
               Route("/metrics", metrics)]
    return Starlette(routes=surface + routes)


def serve(
    argv: list[str], name: str, routes: list[Route], log_level: str = "warning", keep_alive_s: int = 5
) -> int:
    """Serve ``app(name, routes)`` as a process, on ``--port`` from ``argv``."""
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(app(name, routes), host="127.0.0.1", port=args.port, log_level=log_level,
                timeout_keep_alive=keep_alive_s)
    return 0
