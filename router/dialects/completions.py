"""Text completions: OpenAI's ``/v1/completions``, llama-server's own ``/completion`` and ``/infill``."""

from __future__ import annotations

import json
from typing import Any

from macpool.contract import generations
from router.dialects.base import Dialect
from router.tokens import tokenize_body

MAX_PARTS = 256  # blocks hashed for affinity: a longer prompt keeps its node by its first ones
BLOCK_BYTES = 1024  # UTF-8 prompt text per hashed block
BLOCK_TOKENS = 256  # prompt tokens per hashed block when the prompt is a token list


def prompt_blocks(prompt: Any) -> list[bytes]:
    """Fixed-size blocks of the prompt; a partial last block is not one (the next request extends it)."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # OpenAI's batched form with a single prompt
    if isinstance(prompt, str):
        data = prompt[:BLOCK_BYTES * MAX_PARTS].encode(errors="surrogatepass")[:BLOCK_BYTES * MAX_PARTS]
        return [data[i:i + BLOCK_BYTES] for i in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES)]
    if isinstance(prompt, list):
        tokens = prompt[:BLOCK_TOKENS * MAX_PARTS]
        if all(isinstance(t, int) for t in tokens):
            return [json.dumps(tokens[i:i + BLOCK_TOKENS]).encode()
                    for i in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS)]
    return []


class Completions(Dialect):
    name = "completions"
    count_path = "/tokenize"

    def count_body(self, payload: dict[str, Any], body: bytes) -> bytes | None:
        return tokenize_body(payload)

    def generations(self, payload: dict[str, Any]) -> int:
        return generations(payload)

    def prefix_parts(self, payload: dict[str, Any]) -> list[bytes]:
        return prompt_blocks(payload.get("prompt"))


class Infill(Dialect):
    """``/infill``: the prompt is built around the cursor (prefix, suffix, extra context), one generation."""

    name = "infill"


DIALECT = Completions()
INFILL = Infill()
