"""Every API of macpool/apis.py on the simulator: the generation APIs in slots (the deferred queue, a client
leaving), the light ones beside them, and the simulator's own rules (tokens, counts, router mode)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from macpool.apis import APIS
from macpool.sim import tokens
from tests.conftest import Server
from tests.inprocess import LocalStack

pytestmark = pytest.mark.in_process
SimFactory = Callable[..., Server]
LONG = {  # a generation of minutes at --speed 1
    "messages": ("/v1/messages", {"max_tokens": 5000, "messages": [{"role": "user", "content": "A story."}]}),
    "responses": ("/v1/responses", {"max_output_tokens": 5000, "input": "A story."}),
}


def stats(server: Server) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(server.url + "/sim/stats", timeout=10).json()
    return data


def poll(probe: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if probe():
            return True
        time.sleep(0.02)
    return False


def leave_stream(server: Server, path: str, body: dict[str, Any]) -> None:
    """Send ``body`` streamed, read its first event, and go away."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()  # kept: dropping the generator closes the stream
        assert next(chunks).startswith(b"event: ")


def leave_whole(server: Server, path: str, body: dict[str, Any]) -> None:
    """Send ``body`` for a whole answer and give up waiting for it."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path, json=body, timeout=httpx.Timeout(30, read=0.3))


@pytest.mark.parametrize("leave", [leave_stream, leave_whole], ids=["streamed", "whole"])
@pytest.mark.parametrize("api", list(LONG))
def test_a_client_leaving_frees_the_slot(sim: SimFactory, api: str, leave: Callable[..., None]) -> None:
    server = sim("--parallel", "1", "--speed", "1")
    path, body = LONG[api]
    leave(server, path, body)
    assert poll(lambda: stats(server)["cancelled"] == 1 and stats(server)["processing"] == 0)
    assert not any(slot["is_processing"] for slot in httpx.get(server.url + "/slots").json())
    assert stats(server)["completed"] == 0


@pytest.mark.parametrize("api", list(LONG))
def test_a_deferred_request_leaves_the_queue_with_its_client(sim: SimFactory, api: str) -> None:
    server = sim("--parallel", "1", "--speed", "1")
    path, body = LONG[api]
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as running:
        chunks = running.iter_raw()  # kept: dropping the generator closes the stream
        next(chunks)
        leave_whole(server, path, body)  # behind it: deferred until its client gives up
        assert poll(lambda: stats(server)["cancelled"] == 1 and stats(server)["deferred"] == 0)
        assert stats(server)["processing"] == 1  # the first goes on


def test_generation_apis_share_the_slots(sim: SimFactory) -> None:
    server = sim("--parallel", "1", "--speed", "5")  # the first answer takes over a second
    path, body = LONG["messages"]
    short = {"max_output_tokens": 4, "input": "Next."}
    with ThreadPoolExecutor(1) as pool, httpx.stream(
        "POST", server.url + path, json={**body, "max_tokens": 600, "stream": True}, timeout=60,
    ) as running:
        chunks = running.iter_raw()  # kept: dropping the generator closes the stream
        next(chunks)
        waiting = pool.submit(httpx.post, server.url + "/v1/responses", json=short, timeout=60)
        assert poll(lambda: stats(server)["deferred"] == 1)
        assert sum(1 for _ in chunks) > 0  # the first ends...
        answer = waiting.result()  # ...and the waiting one takes its slot
    assert answer.status_code == 200 and answer.json()["usage"]["output_tokens"] == 4
    assert stats(server)["max_concurrent"] == 1


@pytest.mark.parametrize(("path", "body", "inputs"), [
    ("/v1/rerank", {"query": "pool", "documents": ["a pool", "a lake", "a sea"]}, 3),
    ("/v1/embeddings", {"input": ["one", "two"]}, 2),
    ("/embedding", {"content": "one"}, 1),
])
def test_embeddings_and_rerank_take_a_slot_per_input(
    sim: SimFactory, path: str, body: dict[str, Any], inputs: int
) -> None:
    server = sim("--parallel", "4", "--speed", "20")
    assert httpx.post(server.url + path, json=body, timeout=30).status_code == 200
    after = stats(server)
    assert (after["completed"], after["max_concurrent"]) == (inputs, inputs)
    assert after["tokens_predicted_total"] == 0  # a prompt each, nothing generated


def test_light_endpoints_answer_beside_busy_slots(sim: SimFactory) -> None:
    server = sim("--parallel", "1", "--speed", "1")
    path, body = LONG["messages"]
    light = {
        "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses/input_tokens": {"input": "hi"},
        "/responses/input_tokens": {"input": "hi"},
        "/v1/chat/completions/input_tokens": {"messages": [{"role": "user", "content": "hi"}]},
        "/chat/completions/input_tokens": {"messages": [{"role": "user", "content": "hi"}]},
        "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
        "/tokenize": {"content": "hi"},
        "/detokenize": {"tokens": [1]},
    }
    assert set(light) == {path for path, api in APIS.items() if api.light}
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as running:
        chunks = running.iter_raw()  # kept: dropping the generator closes the stream
        next(chunks)
        for light_path, light_body in light.items():
            started = time.monotonic()
            assert httpx.post(server.url + light_path, json=light_body, timeout=10).status_code == 200
            assert time.monotonic() - started < 1.0, light_path
        assert (stats(server)["processing"], stats(server)["deferred"]) == (1, 0)


def test_a_count_is_the_simulated_tokens_of_the_rendered_prompt(sim: SimFactory) -> None:
    server = sim("--speed", "50")
    messages = {"system": "Be brief.", "messages": [{"role": "user", "content": "Count me."}]}
    chat = {"messages": [{"role": "system", "content": "Be brief."}, messages["messages"][0]]}
    prompt = httpx.post(server.url + "/apply-template", json=chat).json()["prompt"]
    n = math.ceil(len(prompt) / tokens.CHARS_PER_TOKEN)
    assert httpx.post(server.url + "/v1/messages/count_tokens", json=messages).json() == {"input_tokens": n}
    responses = {"instructions": "Be brief.", "input": "Count me."}
    counted = httpx.post(server.url + "/v1/responses/input_tokens", json=responses).json()
    assert counted == {"input_tokens": n, "object": "response.input_tokens"}
    answer = httpx.post(server.url + "/v1/messages", json={**messages, "max_tokens": 1}).json()
    assert answer["usage"]["cache_read_input_tokens"] + answer["usage"]["input_tokens"] == n


def test_token_ids_read_back_as_their_text(sim: SimFactory) -> None:
    server = sim("--speed", "50")
    text = "Plain ASCII reads back exactly; é does not."
    ids = httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]
    assert len(ids) == tokens.count(text)
    content = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"]
    assert content.startswith("Plain ASCII reads back exactly; ") and "\ufffd" in content
    # a generation's token ids are its text
    answer = httpx.post(server.url + "/completion", json={"prompt": "Go.", "n_predict": 3, "stream": True})
    chunks = [line for line in answer.text.split("\n\n") if line.strip()][:-1]
    generated = [httpx.Response(200, content=chunk.removeprefix("data: ")).json() for chunk in chunks]
    ids = [token for chunk in generated for token in chunk["tokens"]]
    read = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"]
    assert read == "".join(chunk["content"] for chunk in generated)


def test_router_mode_relays_every_api_to_the_model_named(local_stack: LocalStack) -> None:
    url = local_stack.sim("mac", "--preset", "m4max-64g-32b-q4", "--speed", "50",
                          "--models", "a=m2pro-32g-8b-q4").url
    asks = {
        "/v1/messages": {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"max_output_tokens": 1, "input": "hi"},
        "/v1/rerank": {"query": "q", "documents": ["d"]},
        "/tokenize": {"content": "hi"},
    }
    for path, body in asks.items():
        assert httpx.post(url + path, json={**body, "model": "a"}, timeout=30).status_code == 200, path
    missing = httpx.post(url + "/v1/messages", json=asks["/v1/messages"], timeout=30)
    assert missing.status_code == 400
