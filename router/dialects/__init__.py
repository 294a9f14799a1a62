"""One module per API dialect, each answering the router's few questions about a body in its API's terms:
streamed or not, how many generations, the prompt's parts for prefix affinity, the answer's usage, and
errors in the caller's dialect (router/dialects/base.py). The request path asks the dialect of its path
(macpool/apis.py), never the path string.
"""

from __future__ import annotations

from macpool.apis import APIS, Api
from macpool.apis import Dialect as DialectName
from router.dialects import chat, completions, embeddings, messages, responses, tokenize
from router.dialects.base import Dialect, Usage

__all__ = ["DIALECTS", "Dialect", "Usage", "api_of"]

DIALECTS: dict[DialectName, Dialect] = {
    "chat": chat.DIALECT,
    "completions": completions.DIALECT,
    "completion": completions.DIALECT,
    "infill": completions.INFILL,
    "embeddings": embeddings.DIALECT,
    "rerank": embeddings.DIALECT,
    "messages": messages.DIALECT,
    "responses": responses.DIALECT,
    "tokenize": tokenize.DIALECT,
}


def api_of(path: str) -> tuple[Api, Dialect]:
    """The API served at ``path`` (one of macpool/apis.py) and its dialect."""
    api = APIS[path]
    return api, DIALECTS[api.dialect]
