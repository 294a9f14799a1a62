"""The light endpoints: answered at once from the tokenizer and the chat template, with no slot.

Token counts are of the prompt llama-server would render for the same request on its generation endpoint
(``handle_count_tokens`` in tools/server/server-context.cpp), so a count and the ``prompt_tokens`` of the
answer agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from macpool.sim import anthropic, chat, responses, tokens
from macpool.sim.chat import invalid, type_error

Answer = Callable[[dict[str, Any]], Any]


def tokenize(body: dict[str, Any]) -> dict[str, Any]:
    """``/tokenize``: the ids of ``content`` (a string, or strings and ids mixed), with ``with_pieces``
    each id's text. ``add_special`` adds nothing: the simulated prompts count no BOS token either."""
    if "content" not in body:
        return {"tokens": []}
    content = body["content"]
    if not isinstance(content, str | list):
        raise invalid(type_error("string", content))
    items = content if isinstance(content, list) else [content]
    pieces: list[tuple[int, str]] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            pieces.append((item, tokens.id_piece(item)))
        elif isinstance(item, str):
            pieces += [(tokens.piece_id(piece), piece) for piece in tokens.pieces(item)]
        else:
            raise invalid(type_error("string", item))
    if body.get("with_pieces") is True:
        return {"tokens": [{"id": token, "piece": piece} for token, piece in pieces]}
    return {"tokens": [token for token, _ in pieces]}


def detokenize(body: dict[str, Any]) -> dict[str, Any]:
    ids = body.get("tokens", [])
    if not isinstance(ids, list):
        raise invalid(type_error("array", ids))
    for token in ids:
        if not isinstance(token, int | float):
            raise invalid(type_error("number", token))
    return {"content": tokens.decode([int(token) for token in ids])}


def apply_template(body: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": chat.prompt(body)}


def chat_input_tokens(body: dict[str, Any]) -> dict[str, Any]:
    return responses.count_answer(tokens.count(chat.prompt(body)))


def responses_input_tokens(body: dict[str, Any]) -> dict[str, Any]:
    return responses.count_answer(tokens.count(chat.prompt(responses.to_chat(body))))


def messages_count_tokens(body: dict[str, Any]) -> dict[str, Any]:
    return anthropic.count_answer(tokens.count(chat.prompt(anthropic.to_chat(body))))


ANSWERS: dict[str, Answer] = {
    "/v1/messages/count_tokens": messages_count_tokens,
    "/v1/responses/input_tokens": responses_input_tokens,
    "/responses/input_tokens": responses_input_tokens,
    "/v1/chat/completions/input_tokens": chat_input_tokens,
    "/chat/completions/input_tokens": chat_input_tokens,
    "/apply-template": apply_template,
    "/tokenize": tokenize,
    "/detokenize": detokenize,
}
