"""Slots, the prompt caches and a unified KV cache, the same on the simulator and the real llama-server.

Each test starts its servers with the flags it is about (``launch``), on the generated models: ``tiny``
(a token in well under a millisecond) and ``small`` (a few milliseconds, so two requests overlap).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from macpool.dev import tiny_model
from macpool.dev.redis_server import free_port
from tests.conftest import SpawnFactory
from tests.contract.conftest import Target, _required_binary

Launch = Callable[..., Target]
EXCEEDED = {"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}}


@pytest.fixture(params=["sim", "llama-server"])
def launch(request: pytest.FixtureRequest, spawn: SpawnFactory) -> Launch:
    """``launch(*flags, model="tiny", speed="20")``: a server started with llama-server's ``flags``."""
    started = 0

    def start(*flags: str, model: str = "tiny", speed: str = "20") -> Target:
        nonlocal started
        started += 1
        name = f"{model}.gguf"
        if request.param == "sim":
            servers = request.getfixturevalue("local_stack")
            served = servers.sim(
                f"sim{started}", "--preset", "m5max-128g-14b-q4", *flags, "--speed", speed, "--model", name,
            )
            return Target("sim", served.url, served, model=name)
        path = tiny_model.ensure(model)
        port = free_port()
        argv = [
            _required_binary(), "-m", str(path), "--alias", path.name, "--host", "127.0.0.1",
            "--port", str(port), *flags, "--no-webui", "-t", "1",
        ]
        server = spawn(argv=argv, port=port, name=f"llama-server{started}", timeout=60)
        return Target("llama-server", server.url, server, model=path.name)

    return start


def complete(target: Target, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 4, **fields}
    reply = httpx.post(target.url + "/completion", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def tokens_of(target: Target, text: str) -> int:
    reply = httpx.post(target.url + "/tokenize", json={"content": text}, timeout=30)
    return len(reply.json()["tokens"])


def text_of(target: Target, n_tokens: int, word: str = "pool ") -> str:
    """About ``n_tokens`` tokens of ``word`` repeated, whatever the server's tokenizer."""
    per_word = tokens_of(target, word * 100) / 100
    return word * int(n_tokens / per_word)


def test_a_fresh_server_fills_its_last_slot_first_and_reuses_its_prompt(launch: Launch) -> None:
    target = launch("--parallel", "2", "-c", "2048")
    prompt = "the same instructions every time " * 8
    first = complete(target, prompt)
    again = complete(target, prompt)
    # the least recently used slot, and of those never used the last (llama-server's "<=")
    assert (first["id_slot"], again["id_slot"]) == (1, 1)
    assert first["timings"]["cache_n"] == 0
    # the whole prompt is reused but its last token, which llama-server always evaluates again
    reused = (again["timings"]["cache_n"], again["timings"]["prompt_n"])
    assert reused == (first["timings"]["prompt_n"] - 1, 1)


ALPHA, BRAVO, CHARLIE = ("alpha bravo charlie delta " * 12, "zulu yankee xray whiskey " * 12,
                         "mike november oscar papa " * 12)


@pytest.mark.parametrize("cache", ["8192", "0"])
def test_the_prompt_cache_moves_a_prompt_to_another_slot(launch: Launch, cache: str) -> None:
    # A on slot 1, B on 0, C on 1 (A's): A's next turn lands on slot 0, which held B. With the prompt
    # cache (--cache-ram, on by default) A's prompt, saved as B started, is restored there; without it, A
    # starts over
    target = launch("--parallel", "2", "-c", "2048", "--cache-ram", cache)
    answers = [complete(target, prompt) for prompt in (ALPHA, BRAVO, CHARLIE, ALPHA + " and more")]
    assert [a["id_slot"] for a in answers] == [1, 0, 1, 0]
    reused = answers[-1]["timings"]["cache_n"]
    if cache == "0":
        assert reused < tokens_of(target, ALPHA) // 2
    else:
        assert reused >= tokens_of(target, ALPHA)


def test_a_unified_cache_saves_idle_slots_and_restores_them_anywhere(launch: Launch) -> None:
    # with one pool of cells an idle slot's prompt is saved to the prompt cache and cleared as the next task
    # starts; A's next turn finds no slot holding it, takes the least recently used one, and is restored there
    target = launch("--parallel", "-1", "-c", "2048")
    answers = [complete(target, prompt) for prompt in (ALPHA, BRAVO, ALPHA + " and more")]
    assert [a["id_slot"] for a in answers] == [3, 2, 1]
    assert answers[-1]["timings"]["cache_n"] >= tokens_of(target, ALPHA)


@pytest.mark.parametrize(("flags", "slots", "n_ctx"), [
    (("--parallel", "-1", "-c", "2048"), 4, 2048),  # auto: 4 slots over one unified cache
    (("--parallel", "2", "-c", "2048", "--kv-unified"), 2, 2048),
    (("--parallel", "4", "-c", "2048", "--kv-unified", "--kv-unified-per-slot", "512"), 4, 512),
    (("--parallel", "2", "-c", "2048"), 2, 1024),  # a KV stream per slot: the context split
], ids=["auto", "kvu", "kvu-per-slot", "split"])
def test_a_sequence_may_take_the_context_its_cache_gives_it(
    launch: Launch, flags: tuple[str, ...], slots: int, n_ctx: int
) -> None:
    target = launch(*flags)
    props = httpx.get(target.url + "/props", timeout=10).json()
    assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (slots, n_ctx)
    assert [s["n_ctx"] for s in httpx.get(target.url + "/slots", timeout=10).json()] == [n_ctx] * slots
    fits = text_of(target, n_ctx * 3 // 4)
    answer = complete(target, fits, n_predict=2)
    assert answer["timings"]["prompt_n"] > n_ctx // 2
    too_long = {"prompt": text_of(target, n_ctx + 100)}
    refused = httpx.post(target.url + "/completion", json=too_long, timeout=60)
    error = refused.json()["error"]
    assert (refused.status_code, error["type"], error["n_ctx"]) == (400, "exceed_context_size_error", n_ctx)
    assert error["message"] == (
        f"request ({error['n_prompt_tokens']} tokens) exceeds the available context size ({n_ctx} tokens), "
        "try increasing it"
    )


def test_running_out_of_unified_cells_fails_every_running_task(launch: Launch) -> None:
    # two sequences that each fit the context (2,048 tokens a slot) but not together in its 2,048 cells
    target = launch("--parallel", "-1", "-c", "2048", model="small", speed="2")
    prompt = text_of(target, 900)
    chat = {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 600, "ignore_eos": True,
        "stream": True,
    }

    def streamed() -> tuple[int, list[str]]:
        with httpx.stream("POST", target.url + "/v1/chat/completions", json=chat, timeout=120) as reply:
            return reply.status_code, [line for line in reply.iter_lines() if line]

    def whole() -> httpx.Response:
        body = {"prompt": "x" + prompt, "n_predict": 600, "ignore_eos": True}
        return httpx.post(target.url + "/completion", json=body, timeout=120)

    with ThreadPoolExecutor(2) as pool:
        stream, answer = pool.submit(streamed), pool.submit(whole)
        status, lines = stream.result()
        failed = answer.result()
    assert status == 200 and json.loads(lines[-1].removeprefix("data: ")) == EXCEEDED
    assert "data: [DONE]" not in lines and len(lines) > 2  # tokens came before the error
    assert (failed.status_code, failed.json()) == (500, EXCEEDED)
    assert complete(target, "still serving")["stop"] is True


SYSTEM = "You are a coding agent. Read the repository's rules before you change a file. " * 6


def agent_turn(target: Target, api: str, turns: list[tuple[str, str]]) -> tuple[int, int]:
    """One turn of a conversation (``(role, text)`` after the system prompt) through ``api``: the prompt
    tokens it reports as read from the cache, and all of them."""
    messages = [{"role": role, "content": text} for role, text in turns]
    if api == "chat":
        body: dict[str, Any] = {
            "messages": [{"role": "system", "content": SYSTEM}, *messages], "max_tokens": 4,
        }
        answer = httpx.post(target.url + "/v1/chat/completions", json=body, timeout=60).json()
        usage = answer["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == answer["timings"]["cache_n"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
    if api == "messages":
        body = {"model": target.model, "system": SYSTEM, "messages": messages, "max_tokens": 4}
        usage = httpx.post(target.url + "/v1/messages", json=body, timeout=60).json()["usage"]
        return usage["cache_read_input_tokens"], usage["cache_read_input_tokens"] + usage["input_tokens"]
    # an earlier answer is an output message item in the Responses API
    items = [m if m["role"] == "user" else {"type": "message", "role": "assistant",
                                            "content": [{"type": "output_text", "text": m["content"]}]}
             for m in messages]
    body = {"model": target.model, "instructions": SYSTEM, "input": items, "max_output_tokens": 4}
    usage = httpx.post(target.url + "/v1/responses", json=body, timeout=60).json()["usage"]
    return usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_each_api_reports_the_prompt_it_read_from_the_cache(launch: Launch, api: str) -> None:
    target = launch("--parallel", "2", "-c", "4096", model="fim")
    first = [("user", "Fix the failing test in tests/test_cache.py.")]
    cached, total = agent_turn(target, api, first)
    assert cached == 0 and total > 100
    # the agent sends the whole conversation again, with the answer and the next message
    cached_again, total_again = agent_turn(
        target, api, [*first, ("assistant", "Done: the fixture was stale."), ("user", "Now run the linter.")]
    )
    assert total // 2 <= cached_again < total_again
