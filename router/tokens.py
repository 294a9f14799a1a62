"""A request's prompt tokens: a safe bound from its body, made exact by a node where it matters.

The router has no tokenizer. Every token of a byte-level or SentencePiece vocabulary stands for at least one
byte of text, and a JSON body spells its text with at least as many bytes; a chat template adds role markers
and a preamble the body does not hold. So the body's length plus :data:`TEMPLATE_TOKENS` bounds the prompt
from above - loosely: a real tokenizer makes about one token of four bytes of English or code.

The bound decides where a request may go while it is small next to every node's context. Where it would
matter - it passes the smallest context among the model's nodes, so it could exclude one; or it is long and
one of them shares one pool of cells between its slots, where the tokens reserved are what bounds it - a node
counts the prompt exactly with its own tokenizer and template, through the API's light counting endpoint
(the same body; ``/tokenize`` for a text prompt), and the count replaces the bound. A count that fails keeps
the bound: the request is never refused on a guess (router/forward.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from macpool.contract import NodeDoc

TEMPLATE_TOKENS = 256  # what a chat template may add: role markers, a tool-use preamble, a date line
EXACT_FROM = 2048  # a bound under this is close enough, even where tokens are reserved


def bound(body: bytes) -> int:
    return len(body) + TEMPLATE_TOKENS


def worth_counting(prompt_bound: int, docs: Sequence[NodeDoc]) -> bool:
    """Whether an exact count could change where a request of ``prompt_bound`` tokens may go."""
    contexts = [doc.seq_ctx for doc in docs if doc.seq_ctx > 0]
    if contexts and prompt_bound >= min(contexts):
        return True
    return prompt_bound >= EXACT_FROM and any(doc.kv_unified for doc in docs)


def counted(answer: Any) -> int | None:
    """The count a counting endpoint answered: ``input_tokens`` (Messages, Responses, chat), or the length of
    ``/tokenize``'s ``tokens``."""
    if not isinstance(answer, dict):
        return None
    value = answer.get("input_tokens")
    if type(value) is int and value >= 0:
        return value
    tokens = answer.get("tokens")
    return len(tokens) if isinstance(tokens, list) else None


def tokenize_body(payload: dict[str, Any]) -> bytes | None:
    """``/tokenize``'s body for a completion's text prompt (None: no single text prompt to count)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return None
    return json.dumps({"content": prompt, "add_special": True}).encode()
