"""A stand-in llama-server whose streams linger: ``app("lingering", ROUTES)`` from tests.stand_in, or
``python -m tests.router.lingering_upstream --port P``.

Enough of llama-server's surface for an agent to go ready. ``POST /v1/chat/completions`` answers 200 with an
event stream of one chunk and ``data: [DONE]``, and ends the body only a second and a half later.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.stand_in import serve

EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}\n\n'
LINGER_S = 1.5


async def chat(request: Request) -> Response:
    async def events() -> AsyncIterator[bytes]:
        yield EVENT
        yield b"data: [DONE]\n\n"
        await asyncio.sleep(LINGER_S)

    return StreamingResponse(events(), media_type="text/event-stream")


ROUTES = [Route("/v1/chat/completions", chat, methods=["POST"])]


def main(argv: list[str]) -> int:
    return serve(argv, "lingering", ROUTES, log_level="critical")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
