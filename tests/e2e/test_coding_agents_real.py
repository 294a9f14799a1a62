"""The clients people point at their Macs, through the router, over real llama-servers: the anthropic and
openai SDKs, Claude Code and Codex themselves (headless, from the npm registry: macpool/dev/coding_clis.py).

Two agents each supervise a llama-server serving the tiny model with one 64K-token slot, so that a coding
agent's first turn fits (Claude Code's, sent for a Claude model name, is about 51K of this model's byte-sized
tokens; a real model's tokenizer makes it about 22K). The tiny model never ends an answer by itself and
Claude Code takes a max_tokens stop for a failed turn, so llama-server answers every request with "Hello." (a
grammar);
the prompt, which is what costs, is read whole all the same. The router takes one key, which Claude Code
sends as ``x-api-key`` and Codex as ``Authorization: Bearer``, and maps the CLIs' own model names to the
pool's model (``--model-aliases``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from macpool.dev import coding_clis
from macpool.dev.stack import Stack
from tests.capture_server import Sink, through
from tests.conftest import metric, require_coding_cli

from .conftest import real_setup, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

MODEL = "tiny"
KEY = "sk-pool-key"
CTX = 65536
GRAMMAR = 'root ::= "Hello."'
ALIASES = f"claude-*={MODEL},gpt-*={MODEL}"
# a request that holds its slot until its client leaves: a grammar of its own lets the tiny model run on
HOLD = {"model": MODEL, "prompt": "hold", "n_predict": 30000, "ignore_eos": True, "stream": True,
        "grammar": "root ::= [a-z]+"}


@dataclass
class Pool:
    url: str
    nodes: list[str]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"authorization": f"Bearer {KEY}"})

    def rejections(self) -> float:
        return metric(self.url, 'macpool_rejections_total{reason="pool_full"}')

    def busy(self) -> int:
        doc = httpx.get(self.url + "/api/pool", timeout=5).json()
        return int(doc["pool"]["busy"])

    @contextmanager
    def full(self) -> Iterator[None]:
        """Every slot of the pool held by a stream, until the block ends (its client leaves)."""
        with ExitStack() as held, self.client() as client:
            for _ in self.nodes:
                stream = held.enter_context(client.stream("POST", "/completion", json=HOLD))
                assert stream.status_code == 200, stream.read()
                chunks = stream.iter_raw()
                next(chunks)
                held.callback(lambda chunks=chunks: chunks)  # (a reference: a collected iterator closes)
            yield
        wait_until(lambda: self.busy() == 0, timeout=10, what="the held slots given back")


@pytest.fixture(scope="module")
def pool(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    setup = real_setup(redis_server, tmp_path_factory, "coding-agents")
    keys = setup.logs / "keys"
    keys.write_text(f"{KEY} name=team\n")
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        router = stack.router("router", redis_server, "--queue-size", "0", "--api-keys-file", str(keys),
                              "--model-aliases", ALIASES, wait=False)
        nodes = ["mac-a", "mac-b"]
        for node_id in nodes:
            setup.agent(stack, redis_server, node_id, 1, CTX, llama_args=("--grammar", GRAMMAR))
        stack.wait_serving(router, timeout=30)
        stack.wait_serving(timeout=60)
        stack.wait_nodes(router.url, len(nodes), timeout=90, exact=True)
        yield Pool(router.url, nodes)


@pytest.fixture
def sink() -> Iterator[Sink]:
    proxy = Sink()
    yield proxy
    proxy.close()


# --- the SDKs --------------------------------------------------------------------------------------

TOOLS: list[Any] = [{"name": "read_file", "description": "Read a file",
                     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def test_the_anthropic_sdk_through_the_pool(pool: Pool) -> None:
    client = anthropic.Anthropic(base_url=pool.url, api_key=KEY, max_retries=0, timeout=120)
    messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Say hello."}]
    message = client.messages.create(model="claude-sonnet-4-5", max_tokens=32, messages=messages,
                                     system="You are terse.")
    assert message.model == MODEL and message.stop_reason == "end_turn"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].type == "text" and message.content[0].text == "Hello."
    with client.messages.stream(model="claude-haiku-4-5", max_tokens=32, messages=messages) as stream:
        assert "".join(stream.text_stream) == "Hello."
        assert stream.get_final_message().usage.output_tokens > 0
    counted = client.messages.count_tokens(model="claude-sonnet-4-5", messages=messages,
                                           system="You are terse.")
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    # a tool-use round trip: the assistant's tool_use, the user's tool_result, and the next answer
    round_trip: list[anthropic.types.MessageParam] = [
        *messages,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                           "input": {"path": "README.md"}}]},
        {"role": "user",
         "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "# macpool"}]},
    ]
    answer = client.messages.create(model="claude-sonnet-4-5", max_tokens=32, messages=round_trip,
                                    tools=TOOLS)
    assert answer.content[0].type == "text" and answer.content[0].text == "Hello."
    client.close()


def test_the_openai_sdk_responses_and_chat_through_the_pool(pool: Pool) -> None:
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    response = client.responses.create(model="gpt-5-codex", input="Say hello.", instructions="You are terse.")
    assert response.status == "completed" and response.output_text == "Hello." and response.model == MODEL
    events = list(client.responses.create(model="gpt-5-codex", input="Say hello.", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello."
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}])
    assert chat.choices[0].message.content == "Hello."
    client.close()


def test_a_full_pool_is_an_sdk_retry_not_a_failure(pool: Pool) -> None:
    client = anthropic.Anthropic(base_url=pool.url, api_key=KEY, max_retries=8, timeout=120)
    before = pool.rejections()
    with ThreadPoolExecutor(1) as runner:
        with pool.full():
            asked = runner.submit(client.messages.create, model="claude-sonnet-4-5", max_tokens=32,
                                  messages=[{"role": "user", "content": "Say hello."}])
            wait_until(lambda: pool.rejections() > before, timeout=30, what="the SDK refused a 529")
        message = asked.result(timeout=120)  # retried once the slots were free
    assert message.content[0].type == "text" and message.content[0].text == "Hello."
    client.close()


# --- Claude Code and Codex -------------------------------------------------------------------------

def _turn(cli: str, pool: Pool, tmp_path: Path, sink: Sink) -> coding_clis.Headless:
    require_coding_cli(cli)
    model = "claude-sonnet-4-5" if cli == "claude" else "gpt-5-codex"  # each its own: the router maps them
    key_header = "x-api-key" if cli == "claude" else "authorization"
    turn = coding_clis.headless(cli, base_url=pool.url, model=model, api_key=KEY, workdir=tmp_path / "work",
                                home=tmp_path / "home", prompt="Say hello.", key_header=key_header)
    return through(turn, sink)


def _answer(cli: str, stdout: str) -> str:
    result: str = json.loads(stdout)["result"] if cli == "claude" else stdout.strip()
    return result


def _tokens(pool: Pool) -> float:
    return metric(pool.url, f'macpool_tokens_total{{kind="prompt",model="{MODEL}"}}')


@pytest.mark.coding_cli
@pytest.mark.parametrize(("cli", "least_tokens"), [("claude", 20_000), ("codex", 25_000)])
def test_a_coding_agent_completes_a_turn_through_the_pool(
    cli: str, least_tokens: int, pool: Pool, tmp_path: Path, sink: Sink
) -> None:
    before = _tokens(pool)
    done = _turn(cli, pool, tmp_path, sink).run(timeout=280)
    assert (done.returncode, _answer(cli, done.stdout)) == (0, "Hello."), done.stdout + done.stderr
    assert sink.lines == []  # nothing went anywhere but the pool
    # its whole prompt, counted from the answer's usage once the router has seen the answer end
    wait_until(lambda: _tokens(pool) - before >= least_tokens, timeout=10, what="the turn's prompt tokens")


@pytest.mark.coding_cli
@pytest.mark.parametrize("cli", ["claude", "codex"])
def test_a_coding_agent_sees_a_full_pool_as_a_retry(
    cli: str, pool: Pool, tmp_path: Path, sink: Sink
) -> None:
    turn = _turn(cli, pool, tmp_path, sink)
    before = pool.rejections()
    run: Callable[[], Any] = lambda: turn.run(timeout=280)  # noqa: E731
    with ThreadPoolExecutor(1) as runner:
        with pool.full():
            started = runner.submit(run)
            wait_until(lambda: pool.rejections() > before, timeout=60, what=f"{cli} refused (pool full)")
            time.sleep(1)  # refused again or waiting out its Retry-After: either way it has not given up
            assert not started.done()
        done = started.result(timeout=280)
    assert (done.returncode, _answer(cli, done.stdout)) == (0, "Hello."), done.stdout + done.stderr
