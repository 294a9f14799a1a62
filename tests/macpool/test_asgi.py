"""macpool/asgi.py: direct POST endpoints beside Starlette's routing."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.testclient import TestClient
from starlette.types import Message

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
        # a trailing slash names the same path, for every method, with no redirect
        trailing = client.post("/v1/x/", content=b"hi")
        assert (trailing.status_code, trailing.headers["x-path"]) == (200, "/v1/x")
        assert client.post("/other/").json() == {"routed": "POST"}
        # a page is redirected (its relative links need the right base), by path alone: never to the host
        # the client named
        other = client.get("/other//?a=1", headers={"host": "evil.example"}, follow_redirects=False)
        assert (other.status_code, other.headers["location"]) == (307, "/other?a=1")
    # "//evil.example/x/" as the request target: the redirect stays on this host
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    scope = {"type": "http", "method": "GET", "path": "//evil.example/x/", "raw_path": b"//evil.example/x/",
             "query_string": b"", "headers": [], "root_path": ""}
    asyncio.run(app()(scope, receive, send))
    assert (sent[0]["status"], dict(sent[0]["headers"])[b"location"]) == (307, b"/evil.example/x")


def test_no_redirect_to_the_host_named_or_to_the_same_path() -> None:
    routes = [Route("/other", routed, methods=["GET"]), Mount("/files", routes=[Route("/a", routed)])]
    with TestClient(DirectPosts({}, routes=routes)) as client:
        # Starlette would redirect to the mount's path with a slash, on the host the client named
        mount = client.get("/files", headers={"host": "evil.example"}, follow_redirects=False)
        assert mount.status_code == 404 and "location" not in mount.headers
        assert client.get("/files/a").json() == {"routed": "GET"}
        # a percent-encoded trailing slash: served, not redirected to the same target again and again
        encoded = client.get("/other%2F", follow_redirects=False)
        assert (encoded.status_code, encoded.json()) == (200, {"routed": "GET"})


def test_an_error_in_a_direct_endpoint_is_answered_then_raised() -> None:
    with TestClient(app(), raise_server_exceptions=False) as client:
        response = client.post("/v1/x", content=b"boom")
        assert (response.status_code, response.json()) == (500, {"error": "boom"})
    with TestClient(app()) as client, pytest.raises(RuntimeError, match="boom"):
        client.post("/v1/x", content=b"boom")
