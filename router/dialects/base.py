"""What every dialect answers, with the OpenAI answers as the defaults a dialect module overrides."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response

from macpool.errors import error_response, sse_error


@dataclass(frozen=True)
class Usage:
    """The tokens one answer used, from its API's own usage fields."""

    prompt: int  # every prompt token, cached or not
    completion: int
    cached: int = 0  # of ``prompt``: read from a KV cache instead of processed


SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id")


def canonical(value: Any) -> bytes:
    """One stable encoding of a JSON value (key order does not matter): what prefix hashes hash."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode(errors="surrogatepass")  # a lone surrogate is a valid JSON escape


def last_object(data: bytes, key: bytes, first: bool = False) -> dict[str, Any] | None:
    """The JSON object that follows the last ``"key":`` in ``data`` (the tail of an answer; with ``first``,
    the first), or None. A key inside a string value is escaped there, so only a real key matches."""
    needle = b'"' + key + b'":'
    at = data.find(needle) if first else data.rfind(needle)
    if at < 0:
        return None
    text = data[at + len(key) + 3:].decode(errors="replace").lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def number(value: object) -> int:
    return value if type(value) is int and value >= 0 else 0


def first_limit(payload: dict[str, Any], names: tuple[str, ...]) -> int:
    """The first of the ``names`` fields set in ``payload``, as llama-server reads an output limit (a
    positive integer; anything else sets none)."""
    for name in names:
        value = payload.get(name)
        if value is not None:
            return value if type(value) is int and value > 0 else 0
    return 0


class Dialect:
    """An API's bodies and answers as the router reads them; these defaults are OpenAI's."""

    name = "openai"
    stream_end = b"data: [DONE]\n\n"  # how the stream's last event ends


    def streamed(self, payload: dict[str, Any]) -> bool:
        return payload.get("stream") is True

    def generations(self, payload: dict[str, Any]) -> int:
        """The generations llama-server runs at once for the request, each in a slot of its own."""
        return 1

    # a prompt held in a sequence of the node's KV cache, bounded by its context (not so a batch of inputs to
    # embed or rerank)
    in_context = True
    # where a node counts this API's prompt exactly ("": the router keeps its bound): the same body goes there
    count_path = ""

    def count_body(self, payload: dict[str, Any], body: bytes) -> bytes | None:
        """The body to send to ``count_path`` (None: nothing to count)."""
        return body

    def session(self, headers: Headers, payload: dict[str, Any]) -> str:
        """The session the client names, "" for none: the headers coding agents send (Claude Code's
        ``X-Claude-Code-Session-Id``, Codex's ``session-id``, the generic ``X-Session-Id``), then the body's
        ``prompt_cache_key`` (OpenAI's, which Codex also sends)."""
        for name in SESSION_HEADERS:
            value = headers.get(name)
            if value:
                return value
        key = payload.get("prompt_cache_key")
        return key if isinstance(key, str) else ""

    def output_limit(self, payload: dict[str, Any]) -> int:
        """The most tokens the request lets its answer have (0: it sets no limit)."""
        return first_limit(payload, self.limit_fields)

    # as llama-server reads them: n_predict, or its aliases in this order
    limit_fields: tuple[str, ...] = ("n_predict", "max_completion_tokens", "max_tokens")

    def prefix_parts(self, payload: dict[str, Any]) -> list[bytes]:
        """The prompt in parts, each extending the one before (a message, a block of text), for prefix
        affinity (router/affinity.py); empty when the API has no prompt worth steering for."""
        return []

    def usage(self, head: bytes, tail: bytes) -> Usage | None:
        """The answer's usage, from its first bytes and its last (a stream's last events, or the end of a
        document, where every API puts it), or None when it says none."""
        usage = last_object(tail, b"usage")
        if usage is not None:
            details = usage.get("prompt_tokens_details")
            cached = number(details.get("cached_tokens")) if isinstance(details, dict) else 0
            return Usage(number(usage.get("prompt_tokens")), number(usage.get("completion_tokens")), cached)
        timings = last_object(tail, b"timings")  # a chat stream without include_usage ends with these
        if timings is None:
            return None
        cached = number(timings.get("cache_n"))
        return Usage(cached + number(timings.get("prompt_n")), number(timings.get("predicted_n")), cached)

    # --- errors, in the caller's dialect (macpool/errors.py) ----------------------------------------

    def error(self, status: int, message: str, code: str, headers: dict[str, str] | None = None) -> Response:
        return error_response(status, message, code, headers, dialect=self.name)

    def stream_error(self, status: int, message: str, code: str, *, ended: bool = True) -> bytes:
        """The event that ends a stream on a failure after its first byte."""
        return sse_error(status, message, code, ended=ended, dialect=self.name)

    def upstream_error(self, status: int, document: dict[str, Any]) -> bytes | None:
        """A node's own error document (llama-server's, OpenAI-shaped) in this dialect, or None to relay it
        as it came."""
        return None
