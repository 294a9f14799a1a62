"""A coding agent's session keeps its llama-server slot (node_agent/slots.py), with the openai and anthropic
SDKs through the router over a real llama-server of two slots: a new session that shares the long prefix of a
live one, sent while that one is between turns, does not take its slot; nor, once the agent has found it, the
slot llama-server chose for a Claude Code session (Messages, which names none)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import openai
import pytest

from macpool.dev.stack import Stack
from tests.conftest import metric

from .conftest import real_setup, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

MODEL = "tiny"


@pytest.fixture
def urls(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    setup = real_setup(redis_server, tmp_path_factory, "session-slots")
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        router = stack.router("router", redis_server, wait=False)
        agent = setup.agent(stack, redis_server, "mac", 2, 4096)
        stack.wait_serving(timeout=60)
        stack.wait_nodes(router.url, 1, timeout=90, exact=True)
        yield router.url, agent.url


def test_a_new_session_sharing_a_prefix_leaves_a_live_sessions_slot_alone(urls: tuple[str, str]) -> None:
    router_url, agent_url = urls
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with client:
        _session_keeps_its_slot(client, agent_url)


def _session_keeps_its_slot(client: openai.OpenAI, agent_url: str) -> None:
    instructions = "You are a coding agent; these are your tools and your rules. " * 20

    def turn(session: str, task: str) -> int:
        response = client.responses.create(model=MODEL, instructions=instructions, input=task,
                                           max_output_tokens=1, extra_headers={"session-id": session})
        assert response.usage is not None
        return response.usage.input_tokens_details.cached_tokens

    history = "Fix the build. " + "What the session did so far. " * 30
    turn("a", history)
    turn("b", "Write the docs.")  # a new session of the same agent while a is between turns
    cached = turn("a", history + " And the tests.")
    # a's whole history is still in its slot (all but its last message's end), not the shared part alone
    assert cached > len(instructions) + len(history) - 40
    choices = 'macpool_agent_slot_choices_total{choice="%s"}'
    wait_until(lambda: metric(agent_url, choices % "own") == 1, timeout=5, what="the session's own slot")
    assert metric(agent_url, choices % "free") == 2


def test_a_new_session_does_not_take_the_slot_found_for_a_claude_code_session(urls: tuple[str, str]) -> None:
    router_url, agent_url = urls
    codex = openai.OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    claude = anthropic.Anthropic(base_url=router_url, api_key="unused", max_retries=0, timeout=60)
    with codex, claude:
        _claude_keeps_its_slot(codex, claude, agent_url)


def _claude_keeps_its_slot(codex: openai.OpenAI, claude: anthropic.Anthropic, agent_url: str) -> None:
    choices = 'macpool_agent_slot_choices_total{choice="%s"}'

    def codex_turn(session: str) -> None:
        codex.responses.create(model=MODEL, instructions="You are Codex.", input="Write the docs.",
                               max_output_tokens=1, extra_headers={"session-id": session})

    def claude_turn(messages: list[anthropic.types.MessageParam], max_tokens: int) -> anthropic.types.Message:
        return claude.messages.create(model=MODEL, system="You are Claude Code. " * 40, messages=messages,
                                      max_tokens=max_tokens, extra_headers={"X-Claude-Code-Session-Id": "a"})

    codex_turn("b")  # the agent names a slot no session holds
    task: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Fix the build."}]
    # llama-server chooses: the slot no session holds, found while its answer (up to 1,000 tokens, about a
    # second on the tiny model) is generated
    first = claude_turn(task, 1000)
    assert metric(agent_url, "macpool_agent_slots_found_total") == 1
    codex_turn("c")  # a new session, both slots held by live sessions: b's, idle the longest
    assert (metric(agent_url, choices % "free"), metric(agent_url, choices % "evicted")) == (1, 1)
    answer = "".join(block.text for block in first.content if block.type == "text")
    later = claude_turn([*task, {"role": "assistant", "content": answer},
                         {"role": "user", "content": "And the tests."}], 1)
    # its history is read from its slot: all of the first turn's prompt
    assert (later.usage.cache_read_input_tokens or 0) >= first.usage.input_tokens
