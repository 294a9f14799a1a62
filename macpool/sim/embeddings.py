"""Embeddings and rerank: requests whose tasks process a prompt and generate nothing.

As llama-server (``handle_embeddings_impl``, ``post_rerank`` in tools/server/server-context.cpp), each input
(each document, for rerank) is a task in a slot of its own, processed from scratch (no prompt cache), and the
answer names the request's ``model`` when it gives one. The simulated model embeds a text as a deterministic
unit vector and scores a document by the share of the query's words it contains.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from macpool.sim import tokens
from macpool.sim.chat import invalid, server_error, string, type_error

DIMENSIONS = 64
_BAD_PROMPT = (
    '"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt string, or a '
    "list of mixed strings & tokens."
)
_WORD = re.compile(r"\w+")


def embed(text: str, dims: int = DIMENSIONS) -> list[float]:
    """A deterministic unit vector derived from the text's hash."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [(digest[i % len(digest)] ^ (i * 31 & 0xFF)) / 255.0 - 0.5 for i in range(dims)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


@dataclass
class EmbeddingRequest:
    texts: list[str]
    oai: bool  # the OpenAI document; else llama.cpp's own array (``content`` given, or /embeddings)
    base64: bool


def embedding_request(body: dict[str, Any], oai: bool) -> EmbeddingRequest:
    if "input" in body:
        given = body["input"]
    elif "content" in body:
        given, oai = body["content"], False  # "content" is llama.cpp's own field, answered in its own shape
    else:
        raise invalid('"input" or "content" must be provided')
    as_base64 = False
    if "encoding_format" in body:
        encoding = body["encoding_format"]
        if not isinstance(encoding, str):
            raise invalid(type_error("string", encoding))
        if encoding not in ("float", "base64"):
            raise invalid("The format to return the embeddings in. Can be either float or base64")
        as_base64 = encoding == "base64"
    if isinstance(given, list) and not any(_token(item) for item in given):
        texts = [_subprompt(item) for item in given]  # several inputs
    else:
        texts = [_subprompt(given)]
    if not texts:
        raise invalid('"input" must not be empty')
    return EmbeddingRequest(texts, oai, as_base64)


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _subprompt(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("content"), list):  # OpenAI content parts
        return "".join(string(part, "text") for part in value["content"])
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str | int) for t in value)):
        return tokens.prompt_text(value)
    raise invalid(_BAD_PROMPT)


def embedding_answer(
    request: EmbeddingRequest, model: str, n_tokens: list[int]
) -> dict[str, Any] | list[dict[str, Any]]:
    vectors = [embed(text) for text in request.texts]
    if not request.oai:
        return [{"index": i, "embedding": [vector]} for i, vector in enumerate(vectors)]
    data: list[dict[str, Any]] = []
    for i, vector in enumerate(vectors):
        if request.base64:
            packed = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"embedding": packed, "index": i, "object": "embedding", "encoding_format": "base64"})
        else:
            data.append({"embedding": vector, "index": i, "object": "embedding"})
    total = sum(n_tokens)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": total, "total_tokens": total},
            "data": data}


@dataclass
class RerankRequest:
    query: str
    documents: list[str]
    tei: bool  # Hugging Face TEI's format (``texts``): a bare array of ``score``s; else Jina's document
    top_n: int
    return_text: bool

    def prompts(self) -> list[str]:
        return [f"{self.query}\n{document}" for document in self.documents]


def rerank_request(body: dict[str, Any]) -> RerankRequest:
    if "query" not in body:
        raise invalid('"query" must be provided')
    if not isinstance(body["query"], str):
        raise invalid('"query" must be a string')
    documents: list[str] = next((body[key] for key in ("documents", "texts") if _strings(body.get(key))), [])
    if not documents:
        raise invalid('"documents" must be a non-empty string array')
    top_n = body.get("top_n")
    top_n = int(top_n) if isinstance(top_n, int | float) and math.isfinite(top_n) else len(documents)
    if top_n < 0:  # llama-server resizes its results to it (once they are in): a negative count fails
        raise server_error("vector::_M_default_append")
    tei = "texts" in body
    return_text = tei and body.get("return_text") is True
    return RerankRequest(body["query"], documents, tei, top_n, return_text)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def relevance(query: str, document: str) -> float:
    """The share of the query's words found in the document."""
    wanted = set(_WORD.findall(query.lower()))
    if not wanted:
        return 0.0
    return len(wanted & set(_WORD.findall(document.lower()))) / len(wanted)


def rerank_answer(request: RerankRequest, model: str, n_tokens: list[int]) -> Any:
    label = "score" if request.tei else "relevance_score"
    ranked = []
    for index, document in enumerate(request.documents):
        result: dict[str, Any] = {"index": index, label: relevance(request.query, document)}
        if request.return_text:
            result["text"] = document
        ranked.append(result)
    ranked.sort(key=lambda result: -result[label])
    ranked = ranked[: request.top_n]
    if request.tei:
        return ranked
    total = sum(n_tokens)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": total, "total_tokens": total},
            "results": ranked}


def model_name(body: dict[str, Any], own: str) -> str:
    """The ``model`` of an embeddings or rerank answer: the request's when it names one, else the server's."""
    return string(body, "model", own)
