"""A stand-in llama-server whose streams fail: ``app("failing", ROUTES)`` from
tests.stand_in, or ``python -m tests.node_agent.failing_upstream --port P``.

Enough of llama-server's surface for an agent to go ready. ``POST /v1/chat/completions`` answers 200 with
an event stream that carries llama-server's error event when the prompt says ``error``, and otherwise one
event and then a cut connection.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.stand_in import serve

EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
ERROR = b'data: {"error": {"code": 500, "message": "boom", "type": "server_error"}}\n\n'


async def chat(request: Request) -> Response:
    asks_error = "error" in json.dumps(json.loads(await request.body()).get("messages"))

    async def events() -> AsyncIterator[bytes]:
        yield ERROR if asks_error else EVENT
        if not asks_error:
            raise RuntimeError("cut off mid-stream")  # uvicorn drops the connection

    return StreamingResponse(events(), media_type="text/event-stream")


ROUTES = [Route("/v1/chat/completions", chat, methods=["POST"])]


def main(argv: list[str]) -> int:
    return serve(argv, "failing", ROUTES, log_level="critical")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
