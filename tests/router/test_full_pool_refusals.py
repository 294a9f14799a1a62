"""Refusals while the pool is full, on the wire: once Redis has said "full", every valid request gets the
same 503 (from admission's memory of that answer, in the request's handler), however its body arrives, and
every other request - bad key, bad body, other model, too large - still gets its own answer.

The router runs in this process (uvicorn on a free port, with the Config the CLI builds; real Redis) so
that the memory can be made to outlive the test.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import uvicorn
from redis.asyncio import Redis

from macpool.contract import NodeDoc, now_ms
from macpool.dev.redis_server import free_port
from macpool.serving import server_config
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


def test_refusals_of_a_full_pool_are_the_same_for_every_valid_request(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the memo outlives the whole test (the real one lasts 50 ms and ends at the next full pool refresh)
    monkeypatch.setattr(full_memo, "FULL_MEMO_S", 600.0)
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY} name=team\n")
    settings = Settings(redis_url=redis_url, queue_size=0, refresh_interval=600.0, api_keys_file=keys_file,
                        max_body_bytes=4096)
    app = create_app(settings)
    port = free_port()
    config = server_config(app, keep_alive=75, graceful_shutdown=1, host="127.0.0.1", port=port,
                           log_level="warning", access_log=False)
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
            # the first refusal comes from Redis, and is remembered
            first = await exchange(*request())
            assert first[0] == 503
            assert json.loads(first[2])["error"]["code"] == "pool_full"
            assert first[1]["retry-after"] and first[1]["x-macpool-reason"] == "pool_full"
            # the next ones get the same response
            again = await exchange(*request())
            assert again[0] == 503 and again[2] == first[2]
            assert {k: v for k, v in again[1].items() if k not in ("date", "x-request-id")} == \
                   {k: v for k, v in first[1].items() if k not in ("date", "x-request-id")}
            named = await exchange(*request(extra="X-Request-ID: req-42\r\n"))
            assert named[0] == 503 and named[1]["x-request-id"] == "req-42"
            # a body that arrives in two writes, or chunked
            split = await exchange(*request(chunks=2), pause=0.05)
            assert split[0] == 503 and split[2] == first[2]
            half = len(CHAT) // 2
            chunked = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                       f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
            for part in (CHAT[:half], CHAT[half:], b""):
                chunked += b"%x\r\n%s\r\n" % (len(part), part)
            assert (await exchange(chunked))[0] == 503

            # everything the router would answer otherwise, it still answers
            cases = [
                (request(key="sk-wrong"), 401, "invalid_api_key"),
                (request(key=None), 401, "invalid_api_key"),
                (request(b"{not json"), 400, "invalid_json"),
                (request(extra="X-Macpool-Priority: urgent\r\n"), 400, "invalid_priority"),
                (request(json.dumps({"model": "other", "messages": []}).encode()), 404, "model_not_found"),
                (request(b'{"model": "m", "pad": "' + b"x" * 5000 + b'"}'), 413, "request_too_large"),
            ]
            for parts, status, code in cases:
                got = await exchange(*parts)
                assert (got[0], json.loads(got[2])["error"]["code"]) == (status, code)

            # pipelined requests are answered in order
            writer.write(request()[0] + request(b"{not json")[0] + request()[0])
            await writer.drain()
            assert [(await read_response(reader))[0] for _ in range(3)] == [503, 400, 503]

            metrics = await exchange(b"GET /metrics HTTP/1.1\r\nHost: router\r\n\r\n")
            assert b'macpool_rejections_total{reason="pool_full"} 7.0' in metrics[2]

            # Connection: close is honoured: the router closes after answering
            closing = await exchange(*request(extra="Connection: close\r\n"))
            assert closing[0] == 503 and closing[1].get("connection") == "close"
            assert await asyncio.wait_for(reader.read(), 5) == b""
        finally:
            writer.close()
            server.should_exit = True
            await serving
            await redis.aclose()

    asyncio.run(scenario())
