"""The official OpenAI Python SDK works against the router unchanged, streaming and not."""

from __future__ import annotations

import openai
import pytest

from tests.router.conftest import Pool

pytestmark = pytest.mark.in_process  # none of these tests is about a process


def test_openai_sdk_chat(pool: Pool) -> None:
    pool.node("n1", cap=2)
    router = pool.router()
    pool.wait_ready(router, nodes=1)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]

    completion = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens > 0

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert "".join(pieces)
    client.close()
