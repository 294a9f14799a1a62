"""macpool/asgi.py: the trailing-slash rule, the body bounds and the answer to the server's shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.testclient import TestClient
from starlette.types import Message

from macpool.asgi import (
    BodyTooLarge,
    Guard,
    ShutdownAnswering,
    TrailingSlash,
    UpgradeWithBody,
    read_body,
)


async def echo(request: Request) -> Response:
    try:
        body = await read_body(request, 10)
    except (BodyTooLarge, UpgradeWithBody) as exc:
        return JSONResponse({"refused": type(exc).__name__}, status_code=400)
    return Response(body, headers={"x-path": request.url.path})


async def routed(request: Request) -> Response:
    return JSONResponse({"routed": request.method})


def app(*routes: Route | Mount) -> Starlette:
    routes = routes or (Route("/v1/x", echo, methods=["POST"]),
                        Route("/other", routed, methods=["GET", "POST"]))
    application = Starlette(routes=list(routes), middleware=[Middleware(TrailingSlash)])
    application.router.redirect_slashes = False
    return application


def test_a_trailing_slash_names_the_same_path() -> None:
    with TestClient(app()) as client:
        # for every method but a page's, with no redirect (the OpenAI SDK does not follow them)
        trailing = client.post("/v1/x/", content=b"hi")
        assert (trailing.status_code, trailing.content, trailing.headers["x-path"]) == (200, b"hi", "/v1/x")
        assert client.post("/other//").json() == {"routed": "POST"}
        # a page is redirected (its relative links need the right base), by path alone: never to the host
        # the client named
        page = client.get("/other//?a=1", headers={"host": "evil.example"}, follow_redirects=False)
        assert (page.status_code, page.headers["location"]) == (307, "/other?a=1")
        # a percent-encoded trailing slash: served, not redirected to the same target again and again
        encoded = client.get("/other%2F", follow_redirects=False)
        assert (encoded.status_code, encoded.json()) == (200, {"routed": "GET"})
        assert client.get("/").status_code == 404  # "/" itself is left alone


def test_no_redirect_to_another_host_or_a_mount() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b""}

    # "//evil.example/x/" as the request target: the redirect stays on this host
    scope = {"type": "http", "method": "GET", "path": "//evil.example/x/", "raw_path": b"//evil.example/x/",
             "query_string": b"", "headers": [], "root_path": ""}
    asyncio.run(app()(scope, receive, send))
    assert (sent[0]["status"], dict(sent[0]["headers"])[b"location"]) == (307, b"/evil.example/x")
    # Starlette would redirect to the mount's path with a slash, on the host the client named
    with TestClient(app(Mount("/files", routes=[Route("/a", routed)]))) as client:
        mount = client.get("/files", headers={"host": "evil.example"}, follow_redirects=False)
        assert mount.status_code == 404 and "location" not in mount.headers
        assert client.get("/files/a").json() == {"routed": "GET"}


def test_read_body_bounds_the_size_before_and_while_reading() -> None:
    with TestClient(app()) as client:
        assert client.post("/v1/x", content=b"0123456789").content == b"0123456789"
        declared = client.post("/v1/x", content=b"01234567890")
        assert declared.json() == {"refused": "BodyTooLarge"}

        def chunks() -> object:
            yield b"012345"
            yield b"678901"

        streamed = client.post("/v1/x", content=chunks())  # chunked: no length to go by
        assert streamed.json() == {"refused": "BodyTooLarge"}
        upgrade = client.post("/v1/x", content=b"hi", headers={"connection": "upgrade", "upgrade": "h2c"})
        assert upgrade.json() == {"refused": "UpgradeWithBody"}
        assert client.post("/v1/x", headers={"connection": "upgrade", "upgrade": "h2c"}).status_code == 200


def test_a_request_cancelled_by_the_servers_shutdown_gets_the_answer() -> None:
    started = asyncio.Event()

    async def slow(request: Request) -> Response:
        started.set()
        await asyncio.sleep(60)
        return Response("late")

    def shutting_down(request: Request) -> Response:
        return JSONResponse({"shutdown": True}, status_code=503)

    endpoint = ShutdownAnswering(slow, shutting_down)
    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(60)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        task = asyncio.create_task(endpoint(scope, receive, send))
        await started.wait()
        task.cancel()  # as uvicorn does past its graceful-shutdown timeout
        await task
        assert not task.cancelled()
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
        assert b"".join(m.get("body", b"") for m in sent[1:]) == b'{"shutdown":true}'

    asyncio.run(main())


def test_a_cancellation_that_is_not_the_servers_goes_on() -> None:
    async def taken_back(request: Request) -> Response:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            task.uncancel()  # a Guard's, claimed by the endpoint
        raise asyncio.CancelledError  # a cancellation of the endpoint's own making, not a cancelled task

    endpoint = ShutdownAnswering(taken_back, lambda request: Response(status_code=503))
    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError("nothing is sent")

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(endpoint(scope, receive, send))


def test_a_guard_whose_cancellation_was_swallowed_cancels_the_next_step() -> None:
    # a library swallowed the guard's cancellation (asyncio.wait_for on Python 3.11): the step returns its
    # result, and the next step (the relay) is cancelled at once and cleans up its own way
    async def main() -> tuple[str | None, str | None, list[str]]:
        disconnected = asyncio.Event()
        cleaned: list[str] = []

        async def receive() -> Message:
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def admit() -> str:
            with contextlib.suppress(asyncio.CancelledError):  # swallowed
                await asyncio.sleep(60)
            return "lease"

        async def relay() -> str:
            try:
                await asyncio.sleep(60)
                return "relayed"
            finally:
                cleaned.append("upstream closed")

        guard = Guard(receive)
        asyncio.get_running_loop().call_later(0.01, disconnected.set)
        first = await guard.run(admit())
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # taken back
        async with asyncio.timeout(5):
            second = await guard.run(relay())
        return first, second, cleaned

    first, second, cleaned = asyncio.run(main())
    assert (first, second, cleaned) == ("lease", None, ["upstream closed"])
