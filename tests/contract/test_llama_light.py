"""llama-server's light endpoints (token counts, tokenizer, template) and the path table: the same assertions
hold for the simulator and the real server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from macpool.apis import APIS
from tests.contract.conftest import Target
from tests.contract.shapes import error

CHAT = {"messages": [{"role": "user", "content": "Say hello to the pool."}], "max_tokens": 1}
# a body each dialect answers 200 to
BODIES: dict[str, dict[str, Any]] = {
    "chat": CHAT,
    "completions": {"prompt": "Say hello.", "max_tokens": 1},
    "completion": {"prompt": "Say hello.", "n_predict": 1},
    "infill": {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 1},
    "embeddings": {"input": "Say hello."},
    "rerank": {"query": "pool", "documents": ["a pool of Macs", "a lake"]},
    "messages": {"max_tokens": 1, "messages": [{"role": "user", "content": "Say hello."}]},
    "responses": {"max_output_tokens": 1, "input": "Say hello."},
    "tokenize": {"content": "Say hello.", "tokens": [100, 101]},
}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def post(target: Target, path: str, body: Any) -> httpx.Response:
    return httpx.post(target.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path", list(APIS))
def test_every_path_of_the_table_is_served(api_target: Target, path: str) -> None:
    response = post(api_target, path, BODIES[APIS[path].dialect])
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("messages", "prompt"), [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"),  # text parts: one per line
    ([{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "b"}]}],
     "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": None}], "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"),
    ([], "<|im_start|>assistant\n"),
    ([{"role": "developer", "content": "Rules."}, {"role": "user", "content": "Hi"}],  # developer: system
     "<|im_start|>system\nRules.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}],  # prefilled
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is"),
    ([{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}],
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nA\n\nB"),  # a prefill's parts: a blank line
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": "42"}],
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n"
     "<|im_start|>assistant\n"),
])
def test_the_template_renders_as_llama_servers(api_target: Target, messages: list[Any], prompt: str) -> None:
    # the simulator reports the test model's ChatML template: the prompts are the same text
    response = post(api_target, "/apply-template", {"messages": messages})
    assert response.json() == {"prompt": prompt}


def test_without_the_generation_prompt(api_target: Target) -> None:
    body = {**CHAT, "add_generation_prompt": False}
    prompt = "<|im_start|>user\nSay hello to the pool.<|im_end|>\n"
    assert post(api_target, "/apply-template", body).json() == {"prompt": prompt}


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"])
def test_a_chat_count_is_the_prompt_of_the_answer(api_target: Target, path: str) -> None:
    counted = post(api_target, path, CHAT).json()
    assert counted == {"input_tokens": counted["input_tokens"], "object": "response.input_tokens"}
    answer = post(api_target, "/v1/chat/completions", CHAT).json()
    assert answer["usage"]["prompt_tokens"] == counted["input_tokens"]
    # what llama-server counts is what /tokenize gives for the rendered prompt with its special tokens
    prompt = post(api_target, "/apply-template", CHAT).json()["prompt"]
    ids = post(api_target, "/tokenize", {"content": prompt, "add_special": True}).json()["tokens"]
    assert len(ids) == counted["input_tokens"]


def test_tokenize_and_detokenize(api_target: Target) -> None:
    text = "Say hello to the pool."
    ids = post(api_target, "/tokenize", {"content": text}).json()["tokens"]
    assert ids and all(isinstance(token, int) for token in ids)
    # the test model spells a space as SentencePiece's "\u2581" (in byte tokens, which read back as it is)
    content = post(api_target, "/detokenize", {"tokens": ids}).json()["content"]
    assert content.replace("\u2581", " ").strip() == text
    pieces = post(api_target, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == ids
    assert all(isinstance(piece["piece"], str | list) for piece in pieces)
    mixed = post(api_target, "/tokenize", {"content": [text, 100]}).json()["tokens"]
    assert mixed == [*ids, 100]  # an id in the content is taken as it is
    assert post(api_target, "/tokenize", {}).json() == {"tokens": []}
    assert post(api_target, "/detokenize", {}).json() == {"content": ""}


def test_a_prompt_fills_the_context_one_token_short(api_target: Target) -> None:
    # llama-server refuses a prompt of as many tokens as a slot holds: one must be left to generate
    n_ctx = api_target.n_ctx_per_slot

    def tokens_of(text: str) -> int:
        return len(post(api_target, "/tokenize", {"content": text, "add_special": True}).json()["tokens"])

    lo, hi = 1, 8 * n_ctx  # characters: find the text of exactly n_ctx tokens
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if tokens_of("p" * mid) < n_ctx else (lo, mid)
    full = "p" * lo
    assert tokens_of(full) == n_ctx
    shorter = full[: next(k for k in range(len(full), 0, -1) if tokens_of(full[:k]) == n_ctx - 1)]
    assert post(api_target, "/completion", {"prompt": shorter, "n_predict": 1}).status_code == 200
    refused = post(api_target, "/completion", {"prompt": full, "n_predict": 1})
    assert refused.status_code == 400
    assert refused.json()["error"]["n_prompt_tokens"] == n_ctx


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/apply-template", {}, "'messages' is required"),
    ("/apply-template", {"messages": "x"}, "Expected 'messages' to be an array"),
    ("/v1/chat/completions/input_tokens", {}, "'messages' is required"),
    ("/tokenize", {"content": 5}, "[json.exception.type_error.302] type must be string, but is number"),
    ("/detokenize", {"tokens": "x"}, "[json.exception.type_error.302] type must be array, but is string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "2"},
     "Field 'n': [json.exception.type_error.302] type must be number, but is string"),
])
def test_errors(api_target: Target, path: str, body: dict[str, Any], message: str) -> None:
    response = post(api_target, path, body)
    assert (response.status_code, response.json()) == (400, error(400, "invalid_request_error", message))


def test_answers_name_the_servers_model_but_embeddings_and_rerank_the_requests(api_target: Target) -> None:
    def model(path: str, **named: str) -> str:
        name: str = post(api_target, path, {**BODIES[APIS[path].dialect], **named}).json()["model"]
        return name

    for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
        assert model(path, model="someone-else") == api_target.model
    for path in ("/v1/embeddings", "/v1/rerank"):
        assert model(path, model="someone-else") == "someone-else"
        assert model(path) == api_target.model
