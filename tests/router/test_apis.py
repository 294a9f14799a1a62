"""Every API llama-server serves, through the router: Anthropic Messages and OpenAI Responses with their own
SDKs, the light endpoints, errors in the caller's dialect, model aliases and usage in the metrics."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.conftest import metric, wait_until
from tests.router.conftest import Pool, Server

pytestmark = pytest.mark.in_process  # none of these tests is about a process


def _messages(model: str, max_tokens: int = 8, stream: bool = False, text: str = "Hello") -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": text}]}


def _ready(
    pool: Pool, *args: str, cap: int = 2, parallel: int = 8, speed: float = 50.0
) -> tuple[Server, str]:
    pool.node("n1", cap=cap, parallel=parallel, speed=speed)
    router = pool.router(*args)
    pool.wait_ready(router, nodes=1)
    return router, pool.model(router)


def test_the_anthropic_sdk_creates_streams_and_counts(pool: Pool) -> None:
    router, model = _ready(pool)
    client = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=60)
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Hello"}]
    message = client.messages.create(model=model, max_tokens=8, messages=messages, system="be brief")
    assert message.type == "message" and message.role == "assistant" and message.model == model
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 8
    with client.messages.stream(model=model, max_tokens=8, messages=messages) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    counted = client.messages.count_tokens(model=model, messages=messages, system="be brief")
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    prompt = f'macpool_tokens_total{{kind="prompt",model="{model}"}}'
    completion = f'macpool_tokens_total{{kind="completion",model="{model}"}}'
    assert metric(router.url, completion) == 16  # from each answer's own usage, streamed and not
    unsystemed = client.messages.count_tokens(model=model, messages=messages).input_tokens
    assert metric(router.url, prompt) == counted.input_tokens + unsystemed
    client.close()


def test_the_openai_sdk_creates_and_streams_responses(pool: Pool) -> None:
    router, model = _ready(pool)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.responses.create(model=model, input="Hello", instructions="be brief",
                                       max_output_tokens=8)
    assert response.status == "completed" and response.output_text and response.model == model
    assert response.usage is not None and response.usage.output_tokens == 8
    events = [event.type for event in client.responses.create(model=model, input="Hello", max_output_tokens=8,
                                                               stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events
    client.close()
    completion = f'macpool_tokens_total{{kind="completion",model="{model}"}}'
    assert metric(router.url, completion) == 16


def test_light_endpoints_answer_while_every_slot_generates(pool: Pool) -> None:
    router, model = _ready(pool, "--queue-size", "0", cap=1, parallel=1)
    with httpx.Client(base_url=router.url, timeout=30) as client, client.stream(
        "POST", "/v1/messages", json=_messages(model, max_tokens=4000, stream=True)
    ) as busy:
        assert busy.status_code == 200
        chunks = busy.iter_raw()
        next(chunks)
        refused = client.post("/v1/messages", json=_messages(model))
        assert refused.status_code == 529, refused.text  # the pool is full for generation...
        counts = {
            "/v1/messages/count_tokens": {"model": model, "messages": [{"role": "user", "content": "hi"}]},
            "/v1/responses/input_tokens": {"model": model, "input": "hi"},
            "/v1/chat/completions/input_tokens": {"model": model,
                                                  "messages": [{"role": "user", "content": "hi"}]},
            "/tokenize": {"content": "hi"},
            "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
        }
        for path, body in counts.items():  # ...and answers these at once, holding no slot
            answer = client.post(path, json=body)
            assert answer.status_code == 200, (path, answer.text)
            assert answer.headers["x-macpool-node"] == "n1"
        tokens = client.post("/tokenize", json={"content": "hi"}).json()["tokens"]
        assert client.post("/detokenize", json={"tokens": tokens}).json()["content"] == "hi"


def test_a_full_pool_is_overloaded_in_anthropics_terms_and_unavailable_in_openais(pool: Pool) -> None:
    router, model = _ready(pool, "--queue-size", "0", cap=1, parallel=1, speed=5)  # a stream lasts seconds
    with httpx.Client(base_url=router.url, timeout=30) as client, client.stream(
        "POST", "/v1/chat/completions",
        json={"model": model, "max_tokens": 4000, "stream": True, "ignore_eos": True,
              "messages": [{"role": "user", "content": "x"}]},
    ) as busy:
        chunks = busy.iter_raw()  # (a reference: a collected iterator closes the stream)
        next(chunks)
        full = client.post("/v1/messages", json=_messages(model))
        assert full.status_code == 529 and int(full.headers["retry-after"]) >= 1
        assert full.headers["x-macpool-reason"] == "pool_full"
        assert full.json() == {"type": "error", "error": {
            "type": "overloaded_error", "message": full.json()["error"]["message"], "code": "pool_full"}}
        responses = client.post("/v1/responses", json={"model": model, "input": "hi"})
        assert responses.status_code == 503 and responses.json()["error"]["code"] == "pool_full"
        # the anthropic SDK retries it, honouring Retry-After, then raises its overloaded error
        sdk = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=1, timeout=30)
        with pytest.raises(anthropic.APIStatusError) as raised:
            sdk.messages.create(**_messages(model))
        assert raised.value.status_code == 529 and raised.value.body["error"]["type"] == "overloaded_error"
        sdk.close()
    assert metric(router.url, 'macpool_rejections_total{reason="pool_full"}') == 4  # the SDK asked twice


def test_errors_reach_anthropic_clients_as_anthropic_documents(pool: Pool, tmp_path: Any) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-team\n")
    pool.node("n1", cap=2)
    router = pool.router("--api-keys-file", str(keys))
    pool.wait_ready(router, nodes=1)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        model = client.get("/v1/models", headers={"x-api-key": "sk-team"}).json()["data"][0]["id"]
        missing = client.post("/v1/messages", json=_messages(model))
        assert missing.status_code == 401
        assert missing.json()["type"] == "error" and missing.json()["error"]["type"] == "authentication_error"
        headers = {"x-api-key": "sk-team"}  # what Anthropic clients send
        assert client.post("/v1/messages", json=_messages(model), headers=headers).status_code == 200
        typed = {**headers, "content-type": "application/json"}
        malformed = client.post("/v1/messages", content=b"{", headers=typed)
        assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
        unknown = client.post("/v1/messages", json=_messages("no-such-model"), headers=headers)
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        # over every node's context, as a node counts it: in Anthropic's words, which Claude Code knows
        too_long = client.post("/v1/messages", json=_messages(model, text="word " * 40_000), headers=headers)
        assert too_long.status_code == 400, too_long.text
        error = too_long.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith("prompt is too long: ")
        assert " tokens > 8192 maximum" in error["error"]["message"]  # the largest context in the pool
        chat = client.post("/v1/chat/completions", headers={"authorization": "Bearer sk-team"},
                           json={"model": model, "messages": [{"role": "user", "content": "word " * 40_000}]})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"


def test_aliases_route_agent_model_names_to_a_served_model(pool: Pool) -> None:
    model = "coder"
    pool.node("n1", cap=2, alias=model)
    router = pool.router("--model-aliases", f"claude-*={model},gpt-5-codex={model}")
    pool.wait_ready(router, nodes=1)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        answer = client.post("/v1/messages", json=_messages("claude-sonnet-4-5-20250929"))
        assert answer.status_code == 200 and answer.json()["model"] == model  # the served model's name
        listed = {m["id"]: m["macpool"] for m in client.get("/v1/models").json()["data"]}
        assert listed["gpt-5-codex"]["alias_of"] == model
        assert sorted(listed[model]["aliases"]) == ["claude-*", "gpt-5-codex"]
        assert client.get("/v1/models/claude-haiku-4-5").json()["macpool"]["alias_of"] == model
        unknown = client.post("/v1/responses", json={"model": "gpt-4o", "input": "hi"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_client_leaving_an_anthropic_stream_frees_its_slot(pool: Pool) -> None:
    node = pool.node("n1", cap=1, parallel=1)
    router = pool.router()
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for stream in (True, False):
            body = _messages(model, max_tokens=4000, stream=stream)
            if stream:
                with client.stream("POST", "/v1/messages", json=body) as response:
                    next(response.iter_raw())
            else:  # a non-streamed request the client gives up on before its answer
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/messages", json=body, timeout=httpx.Timeout(30, read=0.5))
            wait_until(lambda: node.stats()["processing"] == 0, timeout=5, interval=0.02)
    pool_doc = httpx.get(router.url + "/api/pool").json()
    assert pool_doc["pool"]["busy"] == 0, json.dumps(pool_doc["pool"])
