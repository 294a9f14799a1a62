"""Refusals below ASGI (macpool/http_guard.py): while Redis's "full" answer is remembered, a valid request
is refused by the router's HTTP protocol with the very response the application would give, and every
other request - bad key, bad body, other model, too large - still gets the application's own answer.

The router runs in this process (uvicorn on a free port, real Redis) so the test can see which requests
were answered early: ``Router.answer`` is wrapped to record its results.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from redis.asyncio import Redis

from macpool.contract import NodeDoc, now_ms
from macpool.http_guard import read_bounded_protocol
from macpool.redis_server import free_port
from macpool.store import Candidate, ReserveRequest, Store
from router import full_memo
from router.app import create_app
from router.settings import Settings

KEY = "sk-early-test"
CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()


def request(body: bytes = CHAT, *, key: str | None = KEY, extra: str = "", chunks: int = 1) -> list[bytes]:
    """A POST to /v1/chat/completions as raw bytes, optionally cut into ``chunks`` writes."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n{auth}{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    data = head + body
    cut = len(head) + len(body) // 2
    return [data] if chunks == 1 else [data[:cut], data[cut:]]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 10)
    return status, headers, body


def test_refusals_below_asgi_match_the_applications_own(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the memo outlives the whole test (the real one lasts 50 ms and ends at the next full pool refresh)
    monkeypatch.setattr(full_memo, "FULL_MEMO_S", 600.0)
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY} name=team\n")
    settings = Settings(redis_url=redis_url, queue_size=0, refresh_interval=600.0, api_keys_file=keys_file,
                        max_body_bytes=4096)
    app = create_app(settings)
    router = app.state.early_answers
    answered: list[int | None] = []  # what the early path returned, per held request
    answer = router.answer

    def recording(path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        response = answer(path, headers, body)
        answered.append(response.status_code if response is not None else None)
        return response

    router.answer = recording
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            http=read_bounded_protocol(30.0, router), lifespan="on")
    server = uvicorn.Server(config)

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        store = Store(redis)
        node = NodeDoc(node_id="full-0", url="http://127.0.0.1:9", models=["m"], capacity=1, total_slots=1,
                       state="ready", updated_at_ms=now_ms())
        await store.heartbeat(node, 600_000)
        held = await store.reserve(ReserveRequest("holder", [Candidate("full-0")], 600_000))
        assert held.status == "reserved"
        serving = asyncio.create_task(server.serve())
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event for it)
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def exchange(*parts: bytes, pause: float = 0.0) -> tuple[int, dict[str, str], bytes]:
            for part in parts:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(pause)
            return await read_response(reader)

        try:
            # the first refusal comes from Redis through the application, and arms the memo
            first = await exchange(*request())
            assert first[0] == 503 and answered == []
            # the next ones are answered below ASGI - with the same response
            early = await exchange(*request())
            assert answered == [503]
            assert early[0] == 503 and early[2] == first[2]
            assert json.loads(early[2])["error"]["code"] == "pool_full"
            assert {k: v for k, v in early[1].items() if k not in ("date", "x-request-id")} == \
                   {k: v for k, v in first[1].items() if k not in ("date", "x-request-id")}
            assert early[1]["retry-after"] and early[1]["x-macpool-reason"] == "pool_full"
            named = await exchange(*request(extra="X-Request-ID: req-42\r\n"))
            assert named[0] == 503 and named[1]["x-request-id"] == "req-42"
            # a body that arrives in two writes is held until it is whole
            split = await exchange(*request(chunks=2), pause=0.05)
            assert split[0] == 503 and answered[-1] == 503
            # and so is a chunked one (the parser hands over the decoded body)
            half = len(CHAT) // 2
            chunked = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                       f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
            for part in (CHAT[:half], CHAT[half:], b""):
                chunked += b"%x\r\n%s\r\n" % (len(part), part)
            before = len(answered)
            assert (await exchange(chunked))[0] == 503 and answered[before:] == [503]

            # everything the application would answer otherwise, it still answers
            cases = [
                (request(key="sk-wrong"), 401, "invalid_api_key"),
                (request(key=None), 401, "invalid_api_key"),
                (request(b"{not json"), 400, "invalid_json"),
                (request(extra="X-Macpool-Priority: urgent\r\n"), 400, "invalid_priority"),
                (request(json.dumps({"model": "other", "messages": []}).encode()), 404, "model_not_found"),
                (request(b'{"model": "m", "pad": "' + b"x" * 5000 + b'"}'), 413, "request_too_large"),
            ]
            for parts, status, code in cases:
                before = len(answered)
                got = await exchange(*parts)
                assert (got[0], json.loads(got[2])["error"]["code"]) == (status, code)
                # declined early (or, for the oversized body, never held), then answered by the application
                assert all(a is None for a in answered[before:])

            # pipelined requests are answered in order: the first early, the second by the application, and
            # the third - behind an answer still in the making - by the application too
            early_before = answered.count(503)
            writer.write(request()[0] + request(b"{not json")[0] + request()[0])
            await writer.drain()
            assert [(await read_response(reader))[0] for _ in range(3)] == [503, 400, 503]
            assert answered.count(503) == early_before + 1

            registry = router.metrics.registry
            refused = registry.get_sample_value("macpool_rejections_total", {"reason": "pool_full"})
            assert refused == 7  # every refusal counted, early or not
            assert answered.count(503) == 5

            # Connection: close is left to the application, which closes after answering
            closing = await exchange(*request(extra="Connection: close\r\n"))
            assert closing[0] == 503 and closing[1].get("connection") == "close"
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert answered.count(503) == 5
        finally:
            writer.close()
            server.should_exit = True
            await serving
            await redis.aclose()

    asyncio.run(scenario())
