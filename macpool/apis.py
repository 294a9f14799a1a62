"""The llama-server APIs the pool serves: each path, the dialect it speaks, and what it costs a node.

A generation API holds one of the node's slots (and its share of the KV cache) while it runs, and goes
through admission: the slot reservation, the bounded queue, 503 when full. A light API is answered at once
from the model's tokenizer or chat template (token counts, templates): it takes no slot and never waits in
the generation queue; routers and agents bound it by a cap of its own (docs/router.md, "Light endpoints").

The router asks the dialect (``router/dialects/``) what it needs of a body; the agent asks it how to fold a
stream back into one document (``node_agent/unstream.py``). Both take the path's entry from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Dialect = Literal[
    "chat", "completions", "completion", "infill", "embeddings", "rerank", "messages", "responses",
    "tokenize",
]


@dataclass(frozen=True)
class Api:
    dialect: Dialect
    light: bool = False  # no generation slot: answered from the tokenizer or the template
    # llama-server reads ``id_slot`` from its body (Messages' conversion drops it; embeddings run no
    # completion task): the agent may name the slot (node_agent/slots.py)
    names_slot: bool = False


APIS: dict[str, Api] = {
    # generation: a slot each (several prompts or n > 1: a slot per generation)
    "/v1/chat/completions": Api("chat", names_slot=True),
    "/chat/completions": Api("chat", names_slot=True),
    "/v1/completions": Api("completions", names_slot=True),
    "/completion": Api("completion", names_slot=True),
    "/completions": Api("completion", names_slot=True),
    "/infill": Api("infill", names_slot=True),
    "/v1/embeddings": Api("embeddings"),
    "/embeddings": Api("embeddings"),
    "/embedding": Api("embeddings"),
    "/v1/rerank": Api("rerank"),
    "/v1/reranking": Api("rerank"),
    "/rerank": Api("rerank"),
    "/reranking": Api("rerank"),
    "/v1/messages": Api("messages"),
    "/v1/responses": Api("responses", names_slot=True),
    "/responses": Api("responses", names_slot=True),
    # light: token counts, templates
    "/v1/messages/count_tokens": Api("messages", light=True),
    "/v1/responses/input_tokens": Api("responses", light=True),
    "/responses/input_tokens": Api("responses", light=True),
    "/v1/chat/completions/input_tokens": Api("chat", light=True),
    "/chat/completions/input_tokens": Api("chat", light=True),
    "/apply-template": Api("chat", light=True),
    "/tokenize": Api("tokenize", light=True),
    "/detokenize": Api("tokenize", light=True),
}

GENERATION_PATHS = tuple(path for path, api in APIS.items() if not api.light)
LIGHT_PATHS = tuple(path for path, api in APIS.items() if api.light)
