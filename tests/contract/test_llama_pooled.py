"""Infill, embeddings and rerank on llama-server: the same assertions hold for the simulator and the real
server (the test model has FIM tokens, and the server runs with --reranking)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.contract.conftest import Target
from tests.contract.shapes import error, skeleton

INFILL = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
          "n_predict": 3}


def post(target: Target, path: str, body: Any) -> httpx.Response:
    return httpx.post(target.url + path, json=body, timeout=60)


def test_infill_answers_as_completion(api_target: Target) -> None:
    infill = post(api_target, "/infill", {**INFILL, "model": "someone-else"})
    assert infill.status_code == 200, infill.text
    answer = infill.json()
    completion = post(api_target, "/completion", {"prompt": "def add(a, b):", "n_predict": 3}).json()
    assert skeleton(answer) == skeleton(completion)
    assert answer["stop"] is True and answer["tokens_predicted"] == 3 and answer["stop_type"] == "limit"
    assert answer["model"] == api_target.model
    for marker in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"):
        assert marker in answer["prompt"]
    assert answer["prompt"].index("<|fim_prefix|>") < answer["prompt"].index("<|fim_suffix|>")
    assert answer["prompt"].endswith("<|fim_middle|>")


def test_infill_streams_as_completion(api_target: Target) -> None:
    response = post(api_target, "/infill", {**INFILL, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in response.text.split("\n\n") if block.strip()]
    assert all(block.startswith("data: ") for block in blocks) and "[DONE]" not in response.text
    chunks = [json.loads(block.removeprefix("data: ")) for block in blocks]
    assert [chunk["stop"] for chunk in chunks] == [False, False, False, True]
    assert [chunk["tokens_predicted"] for chunk in chunks] == [1, 2, 3, 3]


@pytest.mark.parametrize(("body", "message"), [
    ({"input_prefix": "x"}, "[json.exception.out_of_range.403] key 'input_suffix' not found"),
    ({"input_suffix": "x"}, "[json.exception.out_of_range.403] key 'input_prefix' not found"),
    ({}, "[json.exception.out_of_range.403] key 'input_suffix' not found"),
    ({**INFILL, "input_extra": 5}, '"input_extra" must be an array of {"filename": string, "text": string}'),
    ({**INFILL, "input_extra": [{"filename": "a.py"}]},
     'extra_context chunk must contain a "text" field with a string value'),
    ({**INFILL, "input_extra": [{"text": "x", "filename": 5}]},
     'extra_context chunk\'s "filename" field must be a string'),
])
def test_infill_errors(api_target: Target, body: dict[str, Any], message: str) -> None:
    response = post(api_target, "/infill", body)
    assert (response.status_code, response.json()) == (400, error(400, "invalid_request_error", message))


EMBEDDING = {"embedding": ["number"], "index": "number", "object": "string"}


def test_openai_embeddings(api_target: Target) -> None:
    answer = post(api_target, "/v1/embeddings", {"input": ["one", "two"]}).json()
    data = answer.pop("data")
    assert skeleton(answer) == {
        "model": "string", "object": "string", "usage": {"prompt_tokens": "number", "total_tokens": "number"},
    }
    for item in data:
        vector = item.pop("embedding")  # the random test model's may hold a NaN, as null
        assert vector and set(skeleton(vector)) <= {"number", "null"}
        assert skeleton(item) == {key: kind for key, kind in EMBEDDING.items() if key != "embedding"}
    assert [item["index"] for item in data] == [0, 1]
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    encoded = post(api_target, "/v1/embeddings", {"input": "one", "encoding_format": "base64"}).json()
    assert skeleton(encoded["data"]) == [{**EMBEDDING, "embedding": "string", "encoding_format": "string"}]


@pytest.mark.parametrize(("path", "field"), [
    ("/embeddings", "input"), ("/embedding", "input"), ("/embedding", "content"),
    ("/v1/embeddings", "content"),
])
def test_llama_cpp_embeddings(api_target: Target, path: str, field: str) -> None:
    # /embeddings, /embedding and any request giving "content": llama.cpp's own array, a list of vectors each
    answer = post(api_target, path, {field: ["one", "two"]}).json()
    assert [sorted(item) for item in answer] == [["embedding", "index"]] * 2
    assert [item["index"] for item in answer] == [0, 1]
    for item in answer:
        [vector] = item["embedding"]  # pooled: one vector (the random test model's may hold a NaN, as null)
        assert vector and set(skeleton(vector)) <= {"number", "null"}


@pytest.mark.parametrize(("body", "message"), [
    ({}, '"input" or "content" must be provided'),
    ({"input": []}, '"input" must not be empty'),
    ({"input": "x", "encoding_format": "hex"},
     "The format to return the embeddings in. Can be either float or base64"),
    ({"input": {"a": 1}}, '"prompt" elements must be a string, a list of tokens, a JSON object containing a '
                          "prompt string, or a list of mixed strings & tokens."),
])
def test_embedding_errors(api_target: Target, body: dict[str, Any], message: str) -> None:
    response = post(api_target, "/v1/embeddings", body)
    assert (response.status_code, response.json()) == (400, error(400, "invalid_request_error", message))


RERANK = {"query": "what is a pool of Macs", "documents": ["a pool of Macs", "a swimming pool", "a lake"]}


@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/reranking", "/rerank", "/reranking"])
def test_rerank(api_target: Target, path: str) -> None:
    answer = post(api_target, path, {**RERANK, "top_n": 2}).json()
    assert skeleton(answer) == {
        "model": "string", "object": "string", "usage": {"prompt_tokens": "number", "total_tokens": "number"},
        "results": [{"index": "number", "relevance_score": "number"}],
    }
    scores = [result["relevance_score"] for result in answer["results"]]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    assert {result["index"] for result in answer["results"]} < {0, 1, 2}


def test_rerank_in_teis_format(api_target: Target) -> None:
    texts = {"query": RERANK["query"], "texts": RERANK["documents"], "return_text": True}
    answer = post(api_target, "/rerank", texts).json()
    assert skeleton(answer) == [{"index": "number", "score": "number", "text": "string"}]
    assert sorted(result["index"] for result in answer) == [0, 1, 2]
    assert all(result["text"] == RERANK["documents"][result["index"]] for result in answer)


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"documents": ["a"]}, 400, '"query" must be provided'),
    ({"query": 5, "documents": ["a"]}, 400, '"query" must be a string'),
    ({"query": "q"}, 400, '"documents" must be a non-empty string array'),
    ({"query": "q", "documents": ["a", 5]}, 400, '"documents" must be a non-empty string array'),
    ({"query": "q", "documents": ["a"], "top_n": -1}, 500, "vector::_M_default_append"),
])
def test_rerank_errors(api_target: Target, body: dict[str, Any], status: int, message: str) -> None:
    kind = "server_error" if status == 500 else "invalid_request_error"
    response = post(api_target, "/v1/rerank", body)
    assert (response.status_code, response.json()) == (status, error(status, kind, message))
