"""A stand-in llama-server that echoes the request headers it received and answers with hostile headers.

``python -m tests.reliability.echo_upstream --port P``. Enough of llama-server's surface for an agent to go
ready (/health, /props, /v1/models, /metrics); generation endpoints answer
``{"headers": [[k, v], ...], "body": "<the request body>"}``.
"""

from __future__ import annotations

import sys

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.stand_in import serve

# what a misbehaving upstream might send back: hop-by-hop headers, one named by Connection, a forged reason
HOSTILE = {
    "keep-alive": "timeout=999",
    "proxy-authenticate": "Basic realm=upstream",
    "upgrade": "h2c",
    "trailer": "X-Trailer",
    "x-hop-upstream": "private-hop",
    "connection": "x-hop-upstream",
    "x-upstream-kept": "yes",
}


async def echo(request: Request) -> Response:
    body = (await request.body()).decode()
    received = {"headers": [[k, v] for k, v in request.headers.items()], "body": body}
    return JSONResponse(received, headers=HOSTILE)


def main(argv: list[str]) -> int:
    paths = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/completion")
    return serve(argv, "echo", [Route(path, echo, methods=["POST"]) for path in paths])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
