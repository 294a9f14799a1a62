"""A stand-in llama-server whose streams fail: ``app("failing", ROUTES)`` from
tests.stand_in, or ``python -m tests.node_agent.failing_upstream --port P``.

Enough of llama-server's surface for an agent to go ready. ``POST /v1/chat/completions`` answers 200 with
an event stream that carries llama-server's error event when the prompt says ``error``, and otherwise one
event and then a cut connection; ``/v1/messages`` and ``/v1/responses`` send their first event, then cut.
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


FIRST_EVENTS = {
    "/v1/messages": b'event: message_start\ndata: {"type": "message_start", "message": {"content": []}}\n\n',
    "/v1/responses": b'event: response.created\ndata: {"type": "response.created", "response": {}}\n\n',
}


async def cut_after_first_event(request: Request) -> Response:
    first = FIRST_EVENTS[request.url.path]

    async def events() -> AsyncIterator[bytes]:
        yield first
        raise RuntimeError("cut off mid-stream")

    return StreamingResponse(events(), media_type="text/event-stream")


ROUTES = [Route("/v1/chat/completions", chat, methods=["POST"])]
ROUTES += [Route(path, cut_after_first_event, methods=["POST"]) for path in FIRST_EVENTS]


def main(argv: list[str]) -> int:
    return serve(argv, "failing", ROUTES, log_level="critical")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
