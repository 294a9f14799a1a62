"""Embeddings and rerank: one answer document each, no stream, no decode."""

from __future__ import annotations

from typing import Any

from router.dialects.base import Dialect


class Embeddings(Dialect):
    """``/v1/embeddings``, ``/v1/rerank`` and their aliases. However many inputs or documents a request
    holds, it counts one slot: llama-server batches them through its slots without a decode loop."""

    name = "embeddings"
    in_context = False

    def streamed(self, payload: dict[str, Any]) -> bool:
        return False


DIALECT = Embeddings()
