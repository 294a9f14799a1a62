"""Serve a non-streaming generation request from a streamed upstream one.

llama-server notices that a non-streaming client went away only after a second with no result for *any*
task, so on a busy node (or with the agent's own heartbeat polls) an abandoned non-streaming request
keeps its slot until it finishes. A streamed request is cancelled as soon as a write to the closed
connection fails. So the gateway asks llama-server for a stream and assembles the same JSON document
llama-server would have returned.
"""

from __future__ import annotations

import json
from typing import Any

from macpool.contract import generations

ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/completion"})
# fields whose streamed form does not fold back into the non-streamed one faithfully: passed through as is
_UNSUPPORTED = ("logprobs", "top_logprobs", "n_probs", "post_sampling_probs")


def parse(endpoint: str, body: bytes) -> dict[str, Any] | None:
    """A generation request's JSON object; None for another endpoint or a body that is not one (llama-server
    answers malformed JSON with its own 400)."""
    if endpoint not in ENDPOINTS:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply for Python's parser
        return None
    return request if isinstance(request, dict) else None


def streamed_body(endpoint: str, body: bytes) -> bytes | None:
    """The request body asking for a stream, or None when the request should be passed through as is."""
    return streamed(endpoint, parse(endpoint, body))


def streamed(endpoint: str, request: dict[str, Any] | None) -> bytes | None:
    """``request`` (parsed) asking for a stream, or None when it should be passed through as is.

    Passed through: one already streamed, one asking for probabilities, and one running several generations
    (several prompts, ``n``/``n_cmpl`` > 1): llama-server answers each as its own task - ``choices[i]``, or a
    JSON array from ``/completion`` - and the stream interleaves their events.
    """
    if request is None or request.get("stream") or generations(request) != 1:
        return None
    if any(request.get(name) for name in _UNSUPPORTED) or _bad_count(request) or _prompt_list(request):
        return None
    request = {**request, "stream": True}
    if endpoint != "/completion":
        request["stream_options"] = {"include_usage": True}
    return json.dumps(request).encode()


def _bad_count(request: dict[str, Any]) -> bool:
    # anything but a plain 1 (absent meaning 1) is llama-server's to answer, a bad value with its own 400
    counts = (request.get("n"), request.get("n_cmpl"))
    return any(n is not None and not (type(n) is int and n == 1) for n in counts)


def _prompt_list(request: dict[str, Any]) -> bool:
    """A list of prompts, even of one (its answer's shape is llama-server's), not one prompt's token ids."""
    prompt = request.get("prompt")
    return isinstance(prompt, list) and not all(type(token) is int for token in prompt)


class Assembler:
    """Folds llama-server's stream events back into its non-streamed response document."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.events: int = 0
        self.error: dict[str, Any] | None = None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._tokens: list[int] = []
        self._finish_reason: str | None = None
        self._last: dict[str, Any] = {}
        self._extra: dict[str, Any] = {}

    def feed_line(self, line: str) -> None:
        """One line of the SSE body."""
        if not line.startswith("data: "):
            if line.startswith("error: "):  # llama-server's in-stream error event
                self.error = _json_object(line[len("error: ") :]) or {"message": line}
            return
        payload = line[len("data: ") :].strip()
        if payload == "[DONE]":
            return
        event = _json_object(payload)
        if event is None:
            return
        if "error" in event:
            error = event["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
            return
        self.events += 1
        self._fold(event)

    def _fold(self, event: dict[str, Any]) -> None:
        self._last = event
        for key in ("usage", "timings"):
            if key in event:
                self._extra[key] = event[key]
        if self.endpoint == "/completion":
            self._text.append(str(event.get("content") or ""))
            self._tokens += [t for t in event.get("tokens") or [] if isinstance(t, int)]
            return
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
            if self.endpoint == "/v1/completions":
                self._text.append(str(choice.get("text") or ""))
                continue
            delta = choice.get("delta") or {}
            self._text.append(str(delta.get("content") or ""))
            self._reasoning.append(str(delta.get("reasoning_content") or ""))
            for call in delta.get("tool_calls") or []:
                self._merge_tool_call(call)

    def _merge_tool_call(self, call: dict[str, Any]) -> None:
        merged = self._tool_calls.setdefault(
            int(call.get("index", 0)), {"type": "function", "function": {"name": "", "arguments": ""}}
        )
        if call.get("id"):
            merged["id"] = call["id"]
        function = call.get("function") or {}
        merged["function"]["name"] += function.get("name") or ""
        merged["function"]["arguments"] += function.get("arguments") or ""

    def result(self, request: dict[str, Any] | None = None) -> dict[str, Any]:
        """The document llama-server returns for the same request without ``stream``."""
        text = "".join(self._text)
        if self.endpoint == "/completion":
            document = {**self._last, "content": text}
            settings = document.get("generation_settings")
            if isinstance(settings, dict):
                document["generation_settings"] = {**settings, "stream": False}
            wants_tokens = bool(request and request.get("return_tokens"))
            document["tokens"] = self._tokens if wants_tokens else []
            return document
        keys = ("created", "model", "system_fingerprint", "id")
        head: dict[str, Any] = {key: self._last[key] for key in keys if key in self._last}
        if self.endpoint == "/v1/completions":
            choice: dict[str, Any] = {
                "text": text, "index": 0, "logprobs": None, "finish_reason": self._finish_reason,
            }
            return {"choices": [choice], **head, "object": "text_completion", **self._extra}
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reasoning = "".join(self._reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self._tool_calls:
            message["tool_calls"] = [self._tool_calls[index] for index in sorted(self._tool_calls)]
            message["content"] = text or None
        choice = {"finish_reason": self._finish_reason, "index": 0, "message": message}
        return {"choices": [choice], **head, "object": "chat.completion", **self._extra}


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
