"""A coding agent's session keeps its llama-server slot (node_agent/slots.py), with the openai SDK through the
router over a real llama-server of two slots: a new session that shares the long prefix of a live one, sent
while that one is between turns, does not take its slot."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from macpool.dev.stack import Stack
from tests.conftest import metric

from .conftest import real_setup, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

MODEL = "tiny"


@pytest.fixture(scope="module")
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
