"""Serve a non-streaming generation request from a streamed upstream one.

llama-server notices that a non-streaming client went away only after a second with no result for *any*
task, so on a busy node (or with the agent's own heartbeat polls) an abandoned non-streaming request
keeps its slot until it finishes. A streamed request is cancelled as soon as a write to the closed
connection fails. So the gateway asks llama-server for a stream and assembles the same JSON document
llama-server would have returned (``node_agent/assemblers/``, one module per dialect).

Which paths, and in which dialect, is ``macpool/apis.py``'s table; how each dialect's requests are folded
is ``FOLDS`` below.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from macpool.apis import APIS, Dialect
from macpool.contract import generations as requested_generations

from .assemblers import Assembler
from .assemblers.messages import MessagesAssembler
from .assemblers.native import NativeAssembler
from .assemblers.openai import ChatAssembler, CompletionsAssembler
from .assemblers.responses import ResponsesAssembler


@dataclass(frozen=True)
class Fold:
    """How one dialect's non-streamed requests are served from a stream."""

    assembler: Callable[[], Assembler]
    # request fields whose streamed answer does not fold back into the non-streamed one faithfully: a
    # request with any of them is passed through as it is
    unfaithful: tuple[str, ...] = ()
    # asks for usage in the stream (``stream_options.include_usage``): the non-streamed answer has it
    usage_option: bool = False
    # llama-server reads ``n`` and lists of prompts from the body (its Messages converter drops both)
    several: bool = True


# per-token probabilities come in each event, not as the non-streamed answer's one list
_PROBABILITIES = ("logprobs", "top_logprobs", "n_probs", "post_sampling_probs")
# ``response_fields`` filters the native stream's last event only, not the content of the others
_NATIVE = (*_PROBABILITIES, "response_fields")

FOLDS: dict[Dialect, Fold] = {
    "chat": Fold(ChatAssembler, _PROBABILITIES, usage_option=True),
    "completions": Fold(CompletionsAssembler, _PROBABILITIES, usage_option=True),
    "completion": Fold(NativeAssembler, _NATIVE),
    "infill": Fold(NativeAssembler, _NATIVE),
    # Messages and Responses answers carry no probabilities, streamed or not
    "messages": Fold(MessagesAssembler, several=False),
    "responses": Fold(ResponsesAssembler),
}


def fold_of(endpoint: str) -> Fold | None:
    """The fold of a generation path whose non-streamed requests are served from a stream, or None."""
    api = APIS.get(endpoint)
    return None if api is None or api.light else FOLDS.get(api.dialect)


def parse(endpoint: str, body: bytes) -> dict[str, Any] | None:
    """A foldable request's JSON object; None for another endpoint or a body that is not one (llama-server
    answers malformed JSON with its own 400)."""
    if fold_of(endpoint) is None:
        return None
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply for Python's parser
        return None
    return request if isinstance(request, dict) else None


def generations(endpoint: str, request: dict[str, Any]) -> int:
    """How many generations llama-server runs for ``request`` (parsed), each in a slot of its own."""
    fold = fold_of(endpoint)
    return requested_generations(request) if fold is None or fold.several else 1


def streamed_body(endpoint: str, body: bytes) -> bytes | None:
    """The request body asking for a stream, or None when the request should be passed through as is."""
    return streamed(endpoint, parse(endpoint, body))


def streamed(endpoint: str, request: dict[str, Any] | None) -> bytes | None:
    """``request`` (parsed) asking for a stream, or None when it should be passed through as is.

    Passed through: one already streamed, one asking for what does not fold back (probabilities), and one
    running several generations (several prompts, ``n``/``n_cmpl`` > 1): llama-server answers each as its
    own task - ``choices[i]``, or a JSON array - and the stream interleaves their events.
    """
    fold = fold_of(endpoint)
    if fold is None or request is None or request.get("stream"):
        return None
    if any(request.get(name) for name in fold.unfaithful):
        return None
    if fold.several and (requested_generations(request) != 1 or _bad_count(request) or _prompt_list(request)):
        return None
    request = {**request, "stream": True}
    if fold.usage_option:
        request["stream_options"] = {"include_usage": True}
    return json.dumps(request).encode()


def assembler(endpoint: str) -> Assembler:
    """A new assembler for a stream asked for on ``endpoint`` (one ``streamed`` gave a body for)."""
    fold = fold_of(endpoint)
    if fold is None:
        raise ValueError(f"{endpoint!r} is not served from a stream")
    return fold.assembler()


def _bad_count(request: dict[str, Any]) -> bool:
    # anything but a plain 1 (absent meaning 1) is llama-server's to answer, a bad value with its own 400
    counts = (request.get("n"), request.get("n_cmpl"))
    return any(n is not None and not (type(n) is int and n == 1) for n in counts)


def _prompt_list(request: dict[str, Any]) -> bool:
    """A list of prompts, even of one (its answer's shape is llama-server's), not one prompt's token ids."""
    prompt = request.get("prompt")
    return isinstance(prompt, list) and not all(type(token) is int for token in prompt)
