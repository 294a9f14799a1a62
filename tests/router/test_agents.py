"""Coding-agent traffic through the router: requests go where their context fits, a long prompt may wait as
long as it will take, and a session stays on the Mac that holds its prefix."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import metric, wait_until
from tests.router.conftest import Pool

pytestmark = pytest.mark.in_process  # none of these tests is about a process


def test_a_request_goes_where_its_context_fits(pool: Pool) -> None:
    # one Mac with 2 slots of 512 tokens, one with 1 slot of 4,096: a long prompt fits only the second
    small, big = pool.node("small", cap=2, parallel=2, ctx_size=1024), pool.node("big", cap=1, parallel=1,
                                                                                 ctx_size=4096)
    router = pool.router()
    pool.wait_ready(router, nodes=2)
    model = pool.model(router)
    with httpx.Client(base_url=router.url, timeout=60) as client:
        long_text = "word " * 790
        count = client.post("/v1/chat/completions/input_tokens",
                            json={"model": model, "messages": [{"role": "user", "content": long_text}]})
        assert 512 < count.json()["input_tokens"] < 4096
        body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": long_text}]}

        def ask(text: str) -> tuple[int, str]:
            answer = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user",
                                                                                      "content": text}]})
            return answer.status_code, answer.headers.get("x-macpool-node", "")

        with ThreadPoolExecutor(2) as two_at_a_time:
            answers = list(two_at_a_time.map(ask, [long_text] * 8))
            assert answers == [(200, "big")] * 8  # queued for the one node that fits, never a 400
            short = list(two_at_a_time.map(ask, [f"hi {i}" for i in range(8)]))
        assert {status for status, _ in short} == {200}
        assert "small" in {node for _, node in short}  # short requests still use the small node
    assert small.stats()["completed"] >= 1 and big.stats()["completed"] >= 8


def _chat(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": text}], **extra}


def test_a_long_prompt_waits_in_the_queue_about_as_long_as_it_takes(pool: Pool) -> None:
    pool.node("n1", cap=1, parallel=1, speed=5)
    router = pool.router("--queue-timeout", "0.5")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    hold = _chat(model, "x", max_tokens=4000, stream=True, ignore_eos=True)
    with httpx.Client(base_url=router.url, timeout=60) as client, client.stream(
        "POST", "/v1/chat/completions", json=hold
    ) as busy, ThreadPoolExecutor(2) as waiting:
        chunks = busy.iter_raw()  # (a reference: a collected iterator closes the stream)
        next(chunks)
        started = time.monotonic()
        long = waiting.submit(client.post, "/v1/chat/completions", json=_chat(model, "word " * 3000))
        short = client.post("/v1/chat/completions", json=_chat(model, "hi"))
        assert short.status_code == 503 and short.json()["error"]["code"] == "queue_timeout"
        assert time.monotonic() - started < 5  # the short one waits --queue-timeout...
        assert not long.done()  # ...the long one as long again as its prompt takes (not measured: 200 tok/s)
        busy.close()
        assert long.result(timeout=30).status_code == 200


def test_a_session_stays_on_its_mac_whatever_its_prompt_and_whichever_router(pool: Pool) -> None:
    pool.node("a", cap=4)
    pool.node("b", cap=4)
    first, second = pool.router(), pool.stack.router("router-2", pool.redis_url, "--agent-token",
                                                     "router-test-agent-token")
    pool.wait_ready(first, nodes=2)
    pool.wait_ready(second, nodes=2)
    model = pool.model(first)

    def turn(router_url: str, text: str, headers: dict[str, str]) -> str:
        answer = httpx.post(router_url + "/v1/chat/completions", json=_chat(model, text), headers=headers,
                            timeout=30)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-macpool-node"]

    for name in ("x-claude-code-session-id", "session-id", "x-session-id"):
        session = {name: f"{name}-1"}
        home = turn(first.url, "first turn " * 100, session)
        # every turn differs entirely (nothing of it hashed before), on either router: the session keeps it
        nodes = {turn(url, f"turn {i} " * 100, session) for i, url in enumerate([first.url, second.url] * 3)}
        assert nodes == {home}, name


def test_a_nodes_own_context_refusal_moves_the_request_to_one_with_room(pool: Pool) -> None:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tests import stand_in
    from tests.router.conftest import AGENT_TOKEN

    async def too_long(request: Request) -> JSONResponse:  # llama-server's answer: over its context
        error = {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 3000, "n_ctx": 1024,
                 "message": "request (3000 tokens) exceeds the available context size (1024 tokens), try "
                            "increasing it"}
        return JSONResponse({"error": error}, status_code=400)

    pool.node("big", cap=1, parallel=1, speed=5, alias="coder")
    router = pool.router()
    pool.wait_ready(router, nodes=1)
    # a prompt of token ids: no node can count it for the router, so no context keeps it from "small"
    body = {"model": "coder", "prompt": list(range(3, 3003)), "max_tokens": 4}
    refused = 'macpool_upstream_errors_total{kind="context",node="small"}'
    hold = _chat("coder", "x", max_tokens=4000, stream=True, ignore_eos=True)
    with httpx.Client(base_url=router.url, timeout=60) as client, client.stream(
        "POST", "/v1/chat/completions", json=hold
    ) as busy, ThreadPoolExecutor(1) as waiting:
        chunks = busy.iter_raw()  # (a reference: a collected iterator closes the stream)
        next(chunks)
        assert busy.headers["x-macpool-node"] == "big"  # its one slot busy: the request goes to small first
        routes = [Route("/v1/completions", too_long, methods=["POST"])]
        small = pool.stack.serve("small-llama", stand_in.app("coder", routes))
        pool.stack.agent("agent-small", small.url, pool.redis_url, "small", "--cap", "2", "--token",
                         AGENT_TOKEN)
        pool.wait_ready(router, nodes=2)
        answer = waiting.submit(client.post, "/v1/completions", json=body)
        wait_until(lambda: metric(router.url, refused) == 1, timeout=10, what="small's refusal")
        assert not answer.done()  # not the client's: it waits for a node with room
        busy.close()
        moved = answer.result(timeout=30)
    assert moved.status_code == 200, moved.text
    assert moved.headers["x-macpool-node"] == "big"


def test_a_prompt_a_mac_is_still_processing_is_its_backlog_until_the_answer_starts(pool: Pool) -> None:
    # a slow Mac (300 prompt tokens a second), its prompt speed measured on a first answer; no affinity, so
    # the router expects every prompt processed whole (the simulator's cache makes a repeated one quick)
    node = pool.node("slow", cap=2, parallel=2, speed=2, preset="m4max-64g-32b-q4", metrics=True)
    router = pool.router("--no-affinity")
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    repeated = _chat(model, "word " * 1200, max_tokens=3000, stream=True, ignore_eos=True)
    first = {**repeated, "stream": False, "max_tokens": 4}
    assert httpx.post(router.url + "/v1/chat/completions", json=first, timeout=120).status_code == 200

    def pool_doc() -> dict[str, Any]:
        document: dict[str, Any] = httpx.get(router.url + "/api/pool", timeout=5).json()
        return document

    wait_until(lambda: pool_doc()["nodes"][0].get("prefill_tokens_per_s"), timeout=30, what="prompt speed")

    def backlog() -> float:
        return float(pool_doc()["prefill_backlog_s"].get("slow", 0))

    assert backlog() == 0
    with ThreadPoolExecutor(1) as waiting:
        # a new long prompt: its seconds wait on the Mac until its answer starts
        fresh = waiting.submit(httpx.post, router.url + "/v1/chat/completions",
                               json=_chat(model, "other " * 1000), timeout=120)
        wait_until(lambda: backlog() > 0, timeout=10, what="the prompt's backlog")
        assert fresh.result().status_code == 200
    assert backlog() == 0  # answered: its lease, and its backlog, are gone
    with httpx.Client(base_url=router.url, timeout=120) as client, client.stream(
        "POST", "/v1/chat/completions", json=repeated
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # (a reference: a collected iterator closes the stream)
        assert next(lines).startswith("data:")
        # its prompt processed, still answering (3,000 tokens to go): no backlog, whatever was expected of it
        assert node.stats()["processing"] == 1 and backlog() == 0


def test_a_new_session_sharing_a_prefix_leaves_a_live_sessions_slot_alone(pool: Pool) -> None:
    # Codex's sessions share their instructions and tools; llama-server would give a new session the idle
    # slot most like its prompt: the slot of a live session between two turns. Its agent names the slots.
    node = pool.node("mac", cap=4, parallel=4)
    router = pool.router()
    pool.wait_ready(router, nodes=1)
    model = pool.model(router)
    instructions = "You are a coding agent; these are your tools and rules. " * 120

    def turn(session: str, task: str) -> dict[str, Any]:
        body = {"model": model, "max_tokens": 4, "messages": [
            {"role": "system", "content": instructions}, {"role": "user", "content": task}]}
        answer = httpx.post(router.url + "/v1/chat/completions", json=body, headers={"session-id": session},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        usage: dict[str, Any] = answer.json()["usage"]
        return usage

    first = turn("a", "Fix the build. " + "a's history so far. " * 200)
    turn("b", "Write the docs.")  # a new session, while a is between turns
    again = turn("a", "Fix the build. " + "a's history so far. " * 200 + "And the tests.")
    # all of a's history (its last message's end aside) still in its slot, not the shared part alone
    assert again["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 20
    choices = 'macpool_agent_slot_choices_total{choice="%s"}'
    assert metric(node.agent.url, choices % "free") == 2 and metric(node.agent.url, choices % "own") == 1
