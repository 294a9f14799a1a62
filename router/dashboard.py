"""The pool dashboard: the page, its static files, the live SSE stream and the scale hint.

``routes(pool_json, settings)`` returns the routes the router mounts. Everything the page shows comes
from one :class:`~router.scale.ScaleWatch` created here (or handed in by the router when it also runs
the scale webhook in its lifespan), so any number of open pages cost one pool read per interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from router.scale import PoolSource, ScaleConfig, ScaleWatch
from router.settings import Settings

log = logging.getLogger("macpool.router.dashboard")

STATIC_DIR = Path(__file__).resolve().parent / "static"
STREAM_INTERVAL_S = 0.5


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class Dashboard:
    """The endpoints, bound to one watch."""

    def __init__(
        self, watch: ScaleWatch, stopping: Callable[[], bool] = lambda: False,
        unviewable: Callable[[Request], Response | None] = lambda request: None,
    ) -> None:
        self.watch = watch
        self.unviewable = unviewable  # the refusal of a request without the read key, where one is needed
        self.stopping = stopping  # true once the server is shutting down: streams end, pages reconnect
        self.viewers = 0  # open SSE streams

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    async def scale(self, request: Request) -> Response:
        hint = self.unviewable(request) or JSONResponse(await self.watch.hint(),
                                                        headers={"Cache-Control": "no-store"})
        return hint

    async def stream(self, request: Request) -> Response:
        refused = self.unviewable(request)
        if refused is not None:
            return refused
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if request.method == "HEAD":  # the head alone: the stream never ends, and nothing would read it
            return Response(media_type="text/event-stream", headers=headers)
        return StreamingResponse(self._frames(request), media_type="text/event-stream", headers=headers)

    async def _frames(self, request: Request) -> AsyncIterator[bytes]:
        self.viewers += 1
        try:
            yield b"retry: 2000\n\n"
            yield _event("history", {"points": list(self.watch.history)})
            # a stream never ends by itself: left open at shutdown it would hold the router up for its whole
            # --shutdown-timeout, then be cancelled with a traceback
            while not self.stopping() and not await request.is_disconnected():
                yield await self._frame()
                await asyncio.sleep(STREAM_INTERVAL_S)
        finally:
            self.viewers -= 1

    async def _frame(self) -> bytes:
        try:
            frame = await self.watch.sample()
        except Exception as exc:  # a failed read is shown on the page; the stream goes on
            log.warning("dashboard sample failed: %s", exc)
            return _event("problem", {"message": f"pool view unavailable: {type(exc).__name__}"})
        last = self.watch.history[-1] if self.watch.history else None
        return _event("pool", {"view": frame.view, "scale": frame.hint.as_dict(), "point": last})


def routes(
    pool_json: PoolSource, settings: Settings, watch: ScaleWatch | None = None,
    stopping: Callable[[], bool] = lambda: False,
    unviewable: Callable[[Request], Response | None] = lambda request: None,
) -> list[BaseRoute]:
    """GET /dashboard, /static/..., /api/pool/stream (SSE) and /api/pool/scale.

    Pass ``watch`` when the router runs it in its lifespan (``async with watch.running():``) for the
    webhook and gap-free history; without it the watch samples only while someone is looking.
    ``stopping`` says when the server has begun to shut down (the streams then end within an interval).
    ``unviewable`` refuses a request for the pool's figures without the key they need (the page itself and
    its static files hold none: they are open, and the page asks for the key).
    """
    dashboard = Dashboard(watch or ScaleWatch(pool_json, ScaleConfig.from_settings(settings)), stopping,
                          unviewable)
    return [
        Route("/dashboard", dashboard.page, methods=["GET"]),
        Route("/api/pool/stream", dashboard.stream, methods=["GET"]),
        Route("/api/pool/scale", dashboard.scale, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
    ]
