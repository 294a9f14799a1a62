"""A stand-in model API that records what a coding agent sends, for the tests of Claude Code and Codex.

``Capture().app()`` is a Starlette app (serve it with ``local_stack.serve(name, app, ready=None)``). Every
request is kept (method, path, query, headers, body, arrival time). ``POST /v1/messages`` answers in the
Anthropic Messages dialect and ``POST /v1/responses`` in the OpenAI Responses dialect, streamed or not as
asked, with one short text (`ANSWER`), so a client completes a one-line task in one turn;
``/v1/messages/count_tokens`` counts a token a byte; anything else is a 404 in the caller's shape.

``plan`` scripts the first answers to model requests (both dialects): each entry is a `Refusal` (a status,
headers and a JSON body, as a full pool answers) or a `StreamError` (a 200 stream that fails after its first
event); once the plan is spent every request is answered normally.

``Sink`` is a proxy that forwards nothing: a CLI told to use it for everything but loopback shows there
whatever else it would have contacted.

``python -m tests.capture_server claude|codex FILE`` records one turn of the installed CLI into FILE, as
tests/fixtures/clients/ keeps them (docs/coding-clis.md).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socketserver
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from macpool.dev import coding_clis

ANSWER = "Done."
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "cookie", "proxy-authorization"})
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
MODEL_PATHS = (MESSAGES_PATH, RESPONSES_PATH)
Event = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Refusal:
    """A non-200 answer: ``status``, extra ``headers`` and a JSON ``body``."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamError:
    """A 200 stream that fails after its first event: Anthropic's ``error`` event with this error type, or
    a ``response.failed`` whose error has this code (``overloaded_error`` stands for ``server_error``).
    A request that does not stream meets it as a normal answer."""

    kind: str = "overloaded_error"


Planned = Refusal | StreamError


@dataclass
class Captured:
    """One request as it arrived; ``at`` is ``time.monotonic()`` at arrival, ``answer`` what it got:
    ``"ok"``, a refusal's status, or ``"stream-error"``."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    at: float
    answer: str = "ok"

    def json(self) -> Any:
        return json.loads(self.body)

    def record(self) -> dict[str, Any]:
        """This request as a JSON document, the secret headers' values replaced."""
        headers = {k: (_redacted(v) if k in SECRET_HEADERS else v) for k, v in self.headers.items()}
        try:
            body: Any = json.loads(self.body) if self.body else None
        except ValueError:
            body = self.body.decode(errors="replace")
        return {"method": self.method, "path": self.path, "query": self.query, "headers": headers,
                "body_bytes": len(self.body), "body": body}


@dataclass
class Capture:
    """What the stand-in received, and the plan of its next answers to model requests."""

    plan: list[Planned] = field(default_factory=list)
    requests: list[Captured] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self._handle, methods=["GET", "POST", "HEAD"])])

    def model_requests(self) -> list[Captured]:
        """The requests to the model paths, in arrival order."""
        return [r for r in self.requests if r.path in MODEL_PATHS]

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        captured = Captured(request.method, request.url.path, request.url.query, dict(request.headers), body,
                            time.monotonic())
        planned = None
        with self._lock:
            self.requests.append(captured)
            if captured.path in MODEL_PATHS and request.method == "POST" and self.plan:
                planned = self.plan.pop(0)
        if isinstance(planned, Refusal):
            captured.answer = str(planned.status)
            return JSONResponse(planned.body, planned.status, headers=planned.headers)
        if request.method != "POST":
            return _not_found(captured.path)
        document: dict[str, Any] = json.loads(body) if body else {}
        failure = planned if document.get("stream") else None
        if failure is not None:
            captured.answer = "stream-error"
        if captured.path == MESSAGES_PATH:
            return _messages(document, failure)
        if captured.path == MESSAGES_PATH + "/count_tokens":
            return JSONResponse({"input_tokens": len(body)})
        if captured.path == RESPONSES_PATH:
            return _responses(document, failure)
        return _not_found(captured.path)


def _redacted(value: str) -> str:
    """A secret header's value without the secret: its scheme (``Bearer``) stays, as what a server reads."""
    scheme, _, secret = value.partition(" ")
    return f"{scheme} <redacted>" if secret else "<redacted>"


def _event(kind: str, **fields: Any) -> Event:
    """An SSE event whose data names its own type, as both dialects do."""
    return kind, {"type": kind, **fields}


def _sse(events: list[Event]) -> Iterator[bytes]:
    for name, data in events:
        yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _event_stream(events: list[Event]) -> StreamingResponse:
    headers = {"cache-control": "no-cache"}
    return StreamingResponse(_sse(events), media_type="text/event-stream", headers=headers)


def _not_found(path: str) -> Response:
    if path.startswith(MESSAGES_PATH):
        body: dict[str, Any] = {"type": "error", "error": {"type": "not_found_error", "message": path}}
    else:
        body = {"error": {"message": f"no route {path}", "type": "invalid_request_error", "code": None}}
    return JSONResponse(body, 404)


# --- Anthropic Messages ----------------------------------------------------------------------------

def _messages(request: dict[str, Any], failure: StreamError | None) -> Response:
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
               "model": request.get("model", ""), "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 1, "output_tokens": 1, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0}}
    text = {"type": "text", "text": ANSWER}
    if not request.get("stream"):
        return JSONResponse({**message, "content": [text], "stop_reason": "end_turn"})
    events = [_event("message_start", message=message)]
    if failure is not None:
        error = {"type": failure.kind, "message": "the pool is full"}
        return _event_stream([*events, _event("error", error=error)])
    events += [
        _event("content_block_start", index=0, content_block={**text, "text": ""}),
        _event("content_block_delta", index=0, delta={"type": "text_delta", "text": ANSWER}),
        _event("content_block_stop", index=0),
        _event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
               usage={"output_tokens": 1}),
        _event("message_stop"),
    ]
    return _event_stream(events)


# --- OpenAI Responses ------------------------------------------------------------------------------

def _responses(request: dict[str, Any], failure: StreamError | None) -> Response:
    response_id, item_id = f"resp_{uuid.uuid4().hex[:24]}", f"msg_{uuid.uuid4().hex[:24]}"
    part = {"type": "output_text", "text": ANSWER, "annotations": []}
    item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}

    def response(status: str, output: list[Any], **more: Any) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
                "model": request.get("model", ""), "output": output, **more}

    if not request.get("stream"):
        return JSONResponse(response("completed", [item], usage=usage))
    events = [_event("response.created", response=response("in_progress", []))]
    if failure is not None:
        code = "server_error" if failure.kind == "overloaded_error" else failure.kind
        failed = response("failed", [], error={"code": code, "message": "the pool is full"})
        events.append(_event("response.failed", response=failed))
    else:
        at = {"item_id": item_id, "output_index": 0, "content_index": 0}
        events += [
            _event("response.output_item.added", output_index=0,
                   item={**item, "status": "in_progress", "content": []}),
            _event("response.content_part.added", **at, part={**part, "text": ""}),
            _event("response.output_text.delta", **at, delta=ANSWER),
            _event("response.output_text.done", **at, text=ANSWER),
            _event("response.content_part.done", **at, part=part),
            _event("response.output_item.done", output_index=0, item=item),
            _event("response.completed", response=response("completed", [item], usage=usage)),
        ]
    for number, (_, data) in enumerate(events):
        data["sequence_number"] = number
    return _event_stream(events)


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What a recorded request says that a server relies on: where it went, the names of its headers,
    the keys of its body, and its model and stream flag. Two turns of the same CLI version have the same
    summaries; a new version that sends something else does not."""
    body = record["body"] if isinstance(record["body"], dict) else {}
    return {"method": record["method"], "path": record["path"], "query": record["query"],
            "headers": sorted(record["headers"]), "body": sorted(body), "model": body.get("model"),
            "stream": body.get("stream")}


# --- what else a CLI contacts ----------------------------------------------------------------------

class Sink:
    """A proxy on a free loopback port that forwards nothing: ``lines`` are the first lines of what was
    sent through it (``CONNECT api.example.com:443 HTTP/1.1``). ``env()`` points a CLI at it for
    everything but loopback."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        sink = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(2.0)
                try:
                    head = self.request.recv(4096)
                except OSError:
                    head = b""
                sink.lines.append(head.split(b"\r\n", 1)[0].decode(errors="replace"))

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="proxy-sink", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def env(self) -> dict[str, str]:
        names = ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY")
        proxies = {n: self.url for name in names for n in (name, name.lower())}
        return {**proxies, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def through(turn: coding_clis.Headless, sink: Sink) -> coding_clis.Headless:
    """``turn`` with everything but loopback sent to ``sink``."""
    return dataclasses.replace(turn, env={**turn.env, **sink.env()})


# --- recording a turn ------------------------------------------------------------------------------

TASK = "Say hello."
MODEL = "tiny"
API_KEY = "sk-macpool-test"  # the stand-in takes any key


def record(cli: str, target: Path) -> int:
    """Run one turn of ``cli`` against a new stand-in and write every request of it to ``target``."""
    from tests.inprocess import LocalStack

    scratch = Path("/tmp/macpool-clients") / cli  # the same paths each time: the fixture's text is stable
    shutil.rmtree(scratch, ignore_errors=True)
    capture = Capture()
    with LocalStack() as servers:
        served = servers.serve("capture", capture.app(), ready=None)
        turn = coding_clis.headless(cli, base_url=served.url, model=MODEL, api_key=API_KEY,
                                    workdir=scratch / "work", home=scratch / "home", prompt=TASK)
        done = turn.run()
    if done.returncode != 0:
        print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
        return done.returncode
    document = {"package": coding_clis.package(cli).spec, "argv": turn.argv[1:],
                "requests": [r.record() for r in capture.requests]}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(record(sys.argv[1], Path(sys.argv[2])))
