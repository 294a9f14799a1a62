"""macpool/asgi.py: direct POST endpoints beside Starlette's routing."""

from __future__ import annotations

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from macpool.asgi import DirectPosts


async def echo(request: Request) -> Response:
    body = await request.body()
    if body == b"boom":
        raise RuntimeError("boom")
    return Response(body, headers={"x-path": request.url.path})


async def routed(request: Request) -> Response:
    return JSONResponse({"routed": request.method})


async def on_error(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": str(exc)}, status_code=500)


def app() -> DirectPosts:
    routes = [Route("/v1/x", echo, methods=["POST"]), Route("/other", routed, methods=["GET", "POST"])]
    return DirectPosts({"/v1/x": echo}, on_error=on_error, routes=routes)


def test_direct_posts_and_routed_requests_answer_as_before() -> None:
    with TestClient(app()) as client:
        response = client.post("/v1/x", content=b"hi")
        assert (response.status_code, response.content, response.headers["x-path"]) == (200, b"hi", "/v1/x")
        assert client.get("/v1/x").status_code == 405  # other methods are Starlette's
        assert client.post("/other").json() == {"routed": "POST"}
        assert client.get("/missing").status_code == 404


def test_an_error_in_a_direct_endpoint_is_answered_then_raised() -> None:
    with TestClient(app(), raise_server_exceptions=False) as client:
        response = client.post("/v1/x", content=b"boom")
        assert (response.status_code, response.json()) == (500, {"error": "boom"})
    with TestClient(app()) as client, pytest.raises(RuntimeError, match="boom"):
        client.post("/v1/x", content=b"boom")
