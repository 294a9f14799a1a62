"""llama-server's HTTP surface: the same assertions hold for the simulator and the real server."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from node_agent.heartbeat import decoded_so_far
from tests.conftest import wait_until
from tests.contract.conftest import SLOW_REQUEST_S, Target

METRIC_NAMES = [
    "prompt_tokens_total", "prompt_tokens_cached_total", "prompt_seconds_total", "tokens_predicted_total",
    "tokens_predicted_seconds_total", "n_decode_total", "prompt_tokens_seconds", "predicted_tokens_seconds",
    "requests_processing", "requests_deferred",
]


def get(target: Target, path: str) -> httpx.Response:
    return httpx.get(target.url + path, timeout=30)


def test_health_is_ok_with_llama_headers(target: Target) -> None:
    response = get(target, "/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert response.headers["server"] == "llama.cpp"


def test_idle_slots(target: Target) -> None:
    slots = get(target, "/slots").json()
    assert [s["id"] for s in slots] == list(range(target.parallel))
    for slot in slots:
        assert slot["n_ctx"] == target.n_ctx_per_slot
        assert slot["is_processing"] is False


def test_props_and_models(target: Target) -> None:
    props = get(target, "/props").json()
    assert props["total_slots"] == target.parallel
    assert props["default_generation_settings"]["n_ctx"] == target.n_ctx_per_slot
    assert isinstance(props["model_path"], str) and props["model_path"]
    assert isinstance(props["build_info"], str)
    models = get(target, "/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == target.model
    assert models["data"][0]["object"] == "model"


def test_metrics_names(target: Target) -> None:
    response = get(target, "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = parse_metrics(response.text)
    for name in METRIC_NAMES:
        assert f"llamacpp:{name}" in values, name


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block[:80]
        events.append(block[len("data: "):])
    return events


CHAT = {"messages": [{"role": "user", "content": "Say hello to the pool."}]}
STREAMS = {
    "chat": ("/v1/chat/completions", CHAT, True),
    "completions": ("/v1/completions", {"prompt": "Say hello to the pool."}, True),
    "native": ("/completion", {"prompt": "Say hello to the pool."}, False),
}


@pytest.mark.parametrize("kind", list(STREAMS))
def test_stream_framing(target: Target, kind: str) -> None:
    path, body, done_marker = STREAMS[kind]
    request = {**body, "stream": True, "max_tokens": 4, "n_predict": 4, "ignore_eos": True}
    response = httpx.post(target.url + path, json=request, timeout=60)
    assert response.status_code == 200
    assert response.headers.get("x-accel-buffering") == "no"
    events = sse_events(response)
    if done_marker:
        assert events[-1] == "[DONE]"
        events = events[:-1]
    else:
        assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    final = chunks[-1]
    if kind == "native":
        assert all(c["stop"] is False for c in chunks[:-1])
        assert final["stop"] is True and final["tokens_predicted"] == 4
        assert final["timings"]["predicted_n"] == 4
        return
    assert len({c["id"] for c in chunks}) == 1
    assert final["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "timings" in final
    if kind == "chat":
        assert final["object"] == "chat.completion.chunk" and final["id"].startswith("chatcmpl-")
        assert final["choices"][0]["delta"] == {}
    else:
        assert final["usage"]["completion_tokens"] == 4


def test_chat_stream_with_usage(target: Target) -> None:
    request = {**CHAT, "stream": True, "max_tokens": 3, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    response = httpx.post(target.url + "/v1/chat/completions", json=request, timeout=60)
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 3
    assert "timings" in usage_chunk


def test_chat_non_streaming(target: Target) -> None:
    request = {**CHAT, "max_tokens": 5, "ignore_eos": True}
    response = httpx.post(target.url + "/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    timings = body["timings"]
    assert timings["predicted_n"] == 5
    assert timings["cache_n"] + timings["prompt_n"] == body["usage"]["prompt_tokens"]


def test_prompt_longer_than_slot_context(target: Target) -> None:
    prompt = "pool " * (target.n_ctx_per_slot * 2)
    response = httpx.post(target.url + "/completion", json={"prompt": prompt, "n_predict": 2}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == target.n_ctx_per_slot
    assert error["n_prompt_tokens"] > target.n_ctx_per_slot
    assert error["message"].startswith(f"request ({error['n_prompt_tokens']} tokens) exceeds")


def test_malformed_json(target: Target) -> None:
    response = httpx.post(
        target.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("[json.exception.parse_error")


def test_unknown_path(target: Target) -> None:
    response = get(target, "/nope")
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}



def test_several_generations_answer_one_choice_each(target: Target) -> None:
    # n (llama-server's n_cmpl) and several prompts: one task per generation, answered by index
    chat = httpx.post(target.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 3, "ignore_eos": True,
                                                                  "n": 2}, timeout=60).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    for choice in chat["choices"]:
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 3  # one generation's figures, not their sum
    prompts = {"prompt": ["Say hello.", "Say goodbye."], "ignore_eos": True}
    texts = httpx.post(target.url + "/v1/completions", json={**prompts, "max_tokens": 2, "n": 2},
                       timeout=60).json()
    assert [c["index"] for c in texts["choices"]] == [0, 1, 2, 3]  # each prompt n times
    native = httpx.post(target.url + "/completion", json={**prompts, "n_predict": 2}, timeout=60).json()
    assert isinstance(native, list) and [a["index"] for a in native] == [0, 1]
    assert all(a["stop"] is True and a["tokens_predicted"] == 2 for a in native)
    # streamed: the generations' events interleave, each ending on its own; several prompts open with null
    streamed = httpx.post(target.url + "/v1/completions", json={**prompts, "max_tokens": 2, "stream": True},
                          timeout=60)
    events = sse_events(streamed)
    assert events[0] == "null" and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[1:-1]]
    ends = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] == "length")
    assert ends == [0, 1]
    too_many = httpx.post(target.url + "/v1/chat/completions", json={**CHAT, "n": target.parallel + 1},
                          timeout=60)
    assert too_many.status_code == 400
    message = too_many.json()["error"]["message"]
    assert message.startswith(f"Field 'n': Value must be between 1 <= value <= {target.parallel}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompts_generations_process_it_once(target: Target, stream: bool) -> None:
    # llama-server prefills the prompt in the parent task's slot and copies that state to its children:
    # /metrics counts the prompt once, and each generation's timings repeat the parent's prompt figures
    def metric(name: str) -> float:
        return parse_metrics(get(target, "/metrics").text)[f"llamacpp:{name}"]

    names = ["prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total"]
    before = [metric(name) for name in names]
    body = {"prompt": "Count this prompt once. " * 8, "n_predict": 2, "ignore_eos": True, "n": 2,
            "stream": stream}
    response = httpx.post(target.url + "/completion", json=body, timeout=60)
    answers = [json.loads(e) for e in sse_events(response)] if stream else response.json()
    finals = [a for a in answers if a["stop"]]
    assert sorted(a["index"] for a in finals) == [0, 1]
    [(cache_n, prompt_n)] = {(a["timings"]["cache_n"], a["timings"]["prompt_n"]) for a in finals}
    assert cache_n + prompt_n == finals[0]["tokens_evaluated"]
    assert [metric(name) - was for name, was in zip(names, before, strict=True)] == [prompt_n, cache_n, 4]


def test_a_running_requests_tokens_are_in_its_slot_before_they_are_in_the_metrics(target: Target) -> None:
    # the agent's tokens/s adds /slots' n_decoded to tokens_predicted_total (node_agent/heartbeat.py): the
    # counter takes a request's tokens only when it ends
    def predicted() -> float:
        return parse_metrics(get(target, "/metrics").text)["llamacpp:tokens_predicted_total"]

    # idle first: a request of an earlier test still ending would add its tokens meanwhile
    wait_until(lambda: not any(slot["is_processing"] for slot in get(target, "/slots").json()), 30,
               "the slots to be idle")
    before = predicted()
    body = {"prompt": "Tell a long story.", "stream": True, **target.slow_request}
    with httpx.stream("POST", target.url + "/completion", json=body, timeout=120) as response:
        assert response.status_code == 200
        chunks = response.iter_lines()
        for _ in range(20):  # twenty tokens in (an event each, with the blank lines between)
            next(chunks)
        assert decoded_so_far(get(target, "/slots").json()) >= 5
        assert predicted() == before


def test_each_generation_takes_a_slot(target: Target) -> None:
    # why the agent counts generations, not requests, against its cap
    body = {**CHAT, "stream": True, "n": 2, **target.slow_request}
    with httpx.stream("POST", target.url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # keep the generator: dropping it closes the stream
        next(chunks)
        slots = get(target, "/slots").json()
        assert sum(1 for slot in slots if slot["is_processing"]) == 2
    start = time.monotonic()
    while any(slot["is_processing"] for slot in get(target, "/slots").json()):
        assert time.monotonic() - start < 30, "the slots were not freed when the client left"
        time.sleep(0.05)


@pytest.mark.parametrize(("fields", "choices"), [
    ({"prompt": ["Say", 42, "hello."]}, 1),  # strings and token ids mixed: one prompt, tokenized in place
    ({"prompt": [[42, "Say hello."], "Say goodbye."]}, 2),  # a list of prompts, one of them mixed
    ({"n_cmpl": None, "n": 2}, 2),  # a null n_cmpl is absent: n counts
    ({"n": None}, 1),
    ({"n": 2.5}, 2),  # a number read as an integer, then checked: 2.5 runs 2 on 2 slots
    ({"n": True}, 1),
])
def test_how_many_generations_a_request_runs(target: Target, fields: dict[str, object], choices: int) -> None:
    # what macpool/contract.py generations() counts against a node's cap must be what llama-server runs
    body = {"prompt": "Say hello.", "max_tokens": 1, **fields}
    response = httpx.post(target.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == list(range(choices))


LEAVING = {
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Tell a long story."}]}),
    "responses": ("/v1/responses", {"input": "Tell a long story."}),
}


@pytest.mark.parametrize("api", list(LEAVING))
def test_a_client_leaving_a_stream_cancels_its_task(target: Target, api: str) -> None:
    # llama-server cancels a streamed task at its first write after the client went away, in every dialect
    path, body = LEAVING[api]
    n = target.slow_request["max_tokens"]
    request = {**body, "max_tokens": n, "max_output_tokens": n, "stream": True}
    with httpx.stream("POST", target.url + path, json=request, timeout=120) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: dropping the generator closes the stream
        next(chunks)  # the first event: the task holds its slot
        assert any(slot["is_processing"] for slot in get(target, "/slots").json())
    left, decoded = time.monotonic(), 0
    while busy := [slot for slot in get(target, "/slots").json() if slot["is_processing"]]:
        decoded = max([decoded, *(slot["next_token"][0]["n_decoded"] for slot in busy)])
        assert time.monotonic() - left < 30, "the slot was not freed when the client left"
        time.sleep(0.02)
    assert decoded < 0.8 * n, "the task ran on after its client left"


@pytest.mark.parametrize("api", list(LEAVING))
def test_a_client_leaving_a_whole_answer_cancels_its_task_once_the_server_is_quiet(
    target: Target, api: str
) -> None:
    # a task answered whole is cancelled once llama-server has had no result of any task for a second and
    # looks at the connection: so this test sends nothing while it waits (a /slots poll would be such a
    # result, and keep the abandoned task running to its end)
    path, body = LEAVING[api]
    n = target.slow_request["max_tokens"]
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(target.url + path, json={**body, "max_tokens": n, "max_output_tokens": n},
                   timeout=httpx.Timeout(30, read=0.1))
    time.sleep(SLOW_REQUEST_S / 2)  # the answer would take SLOW_REQUEST_S
    assert not any(slot["is_processing"] for slot in get(target, "/slots").json())
