"""A stand-in llama-server that closes an idle connection after one second: ``app("impatient", ROUTES)``
from tests.stand_in served with a keep-alive of 1 s, or ``python -m tests.node_agent.impatient_upstream
--port P``.

Enough of llama-server's surface for an agent to go ready; ``POST /v1/chat/completions`` answers a one-word
completion at once.
"""

from __future__ import annotations

import sys

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.stand_in import serve

ANSWER = {"object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"}]}


async def chat(request: Request) -> Response:
    await request.body()
    return JSONResponse(ANSWER)


ROUTES = [Route("/v1/chat/completions", chat, methods=["POST"])]


def main(argv: list[str]) -> int:
    return serve(argv, "impatient", ROUTES, log_level="critical", keep_alive_s=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
