"""``/tokenize`` and ``/detokenize``: llama-server's tokenizer, no model named in the body."""

from __future__ import annotations

from typing import Any

from router.dialects.base import Dialect


class Tokenize(Dialect):
    name = "tokenize"
    in_context = False

    def streamed(self, payload: dict[str, Any]) -> bool:
        return False


DIALECT = Tokenize()
