"""llama-server's KV cache as the heartbeat reports it: its arguments read (flags, LLAMA_ARG_* variables),
where they are read from in attach mode, and the node document's fields against the simulator.

tests/e2e/test_real_kv.py holds the figures to what the real llama-server builds."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from node_agent.kv import KvCache, LlamaArgs, attached, layout, parse_args
from tests.conftest import Server
from tests.node_agent.helpers import AgentFactory, read_node, status, wait_until

SimFactory = Callable[..., Server]


def test_arguments_flags_beat_variables_and_the_last_flag_wins() -> None:
    assert parse_args([]) == LlamaArgs()
    assert LlamaArgs().unified and LlamaArgs().slots == 4  # --parallel at auto
    argv = ["-m", "x.gguf", "-np", "6", "--ctx_size", "49152", "-kvu", "--predict", "512", "--no-kv-unified"]
    assert parse_args(argv) == LlamaArgs(parallel=6, ctx_size=49152, n_predict=512)
    env = {"LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_KV_UNIFIED": "on", "LLAMA_ARG_N_PREDICT": "64"}
    assert parse_args(["-n", "128"], env) == LlamaArgs(parallel=3, kv_unified=True, n_predict=128)
    # --parallel at auto shares the cache whatever -no-kvu says (tools/server/server.cpp)
    assert parse_args(["-no-kvu"]).unified
    assert parse_args(["--parallel", "2", "-c", "lots"]) == LlamaArgs(parallel=2)  # refused: not started


@pytest.mark.parametrize(
    ("argv", "slots", "n_ctx_slot", "expected"),
    [
        # an uneven split: the context, then each sequence's share, rounded up to 256 cells
        (["--parallel", "3", "-c", "10000"], 3, 3584, KvCache(3584, False, 10752, -1)),
        # left to the model, a split cache is its slots' contexts (what memory allowed, seen in /props)
        (["--parallel", "2"], 2, 8192, KvCache(8192, False, 16384, -1)),
        # a shared cache of an explicit -c 0 is the whole training context, above one sequence's cap
        (["--parallel", "4", "-kvu", "--kv-unified-per-slot", "8192", "-c", "0"], 4, 8192,
         KvCache(8192, True, 65536, -1)),
        # a context above the training one: each sequence gets the training context, the pool keeps all
        (["-c", "131072", "-n", "256"], 4, 65536, KvCache(65536, True, 131072, 256)),
    ],
)
def test_the_cache_the_arguments_build(
    argv: list[str], slots: int, n_ctx_slot: int, expected: KvCache
) -> None:
    assert layout(parse_args(argv), slots, n_ctx_slot, n_ctx_train=65536) == expected


def test_attached_arguments_come_from_the_listening_process_else_after_dashes_else_defaults(
    sim: SimFactory,
) -> None:
    upstream = sim("--parallel", "2", "-c", "8192", "--speed", "20")
    found = attached(upstream.url, ["--parallel", "9"], 2)
    assert found.known and found.said.startswith("its command line (pid ")
    assert found.args == LlamaArgs(parallel=2, ctx_size=8192)
    # a process that is not the llama-server /props describes (another slot count) is not believed
    mismatch = attached(upstream.url, ["--parallel", "3", "-kvu"], 3)
    assert mismatch.args == LlamaArgs(parallel=3, kv_unified=True)
    assert mismatch.said.startswith("the arguments after -- (the process listening on its port (pid ")
    # an llama-server on another host: the arguments after --, or llama-server's defaults
    remote = "http://192.0.2.7:8080"  # (TEST-NET-1: no interface of this machine has it)
    declared = attached(remote, ["-np", "2", "-c", "32768"], 2)
    assert declared.known and declared.said == "the arguments after -- (192.0.2.7 is not this machine)"
    defaults = attached(remote, ["-np", "8"], 4)
    assert not defaults.known and defaults.args == LlamaArgs()
    assert defaults.said == ("llama-server's defaults (192.0.2.7 is not this machine; the arguments after -- "
                             "give 8 slots, /props says 4)")


def prompt_totals(upstream: Server) -> tuple[float, float]:
    """The prompt tokens llama-server processed and the seconds it counts for them (/metrics)."""
    metrics = httpx.get(upstream.url + "/metrics", timeout=5).text
    totals = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith(("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total"))}
    return totals["llamacpp:prompt_tokens_total"], totals["llamacpp:prompt_seconds_total"]


def test_heartbeat_carries_the_cache_what_it_holds_and_the_prefill_speed(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "3", "-c", "12288", "-n", "100", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.kv_cells and d, what="its cache")
    assert (doc.seq_ctx, doc.kv_unified, doc.kv_cells, doc.n_predict) == (4096, False, 12288, 100)
    assert doc.kv_cells_used == 0 and doc.prefill_tokens_per_s is None
    shown = status(gateway.url)["kv"]
    assert shown["from"].startswith("its command line (pid ") and shown["args"]["parallel"] == 3

    prompt = " ".join(f"word{i}" for i in range(800))  # about 1,600 tokens (4 characters a token)
    body = {"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for _ in response.iter_raw():  # while it generates, its slot holds the prompt and the output so far
            held = read_node(redis_url, "n1")
            if held is not None and held.kv_cells_used > 1000:
                break
        else:
            pytest.fail("no heartbeat showed the cells the running request holds")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.prefill_tokens_per_s and d,
                     what="a prefill speed")
    first, seconds = prompt_totals(upstream)
    assert doc.prefill_tokens_per_s == pytest.approx(first / seconds, rel=0.01)
    # one prompt from its start: its tokens sat half its length in, on average
    assert doc.prefill_depth == pytest.approx(first / 2, abs=2)
    # the next turn: the prompt again, held in the slot, and as much again after it
    more = prompt + " " + " ".join(f"more{i}" for i in range(800))
    answer = httpx.post(gateway.url + "/v1/completions", json={"prompt": more, "max_tokens": 1}, timeout=60)
    assert answer.status_code == 200
    deeper = wait_until(
        lambda: (d := read_node(redis_url, "n1")) and d.prefill_depth != doc.prefill_depth and d,
        what="the next prefill reading",
    )
    # its tokens sat after the prompt its slot held: smoothed, the depth moves a share of the way there
    assert doc.prefill_depth is not None and deeper.prefill_depth is not None
    assert deeper.prefill_depth - doc.prefill_depth > 0.1 * (first + 400 - doc.prefill_depth)


def test_prompts_processed_side_by_side_count_the_macs_speed_not_one_slots(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    """llama-server's prompt seconds add each slot's: two prompts processed together count their time twice.
    Routers weigh a prompt at the speed the whole Mac processes prompts (the prompts ahead of it in the
    backlog), so the agent divides the tokens by the seconds in which it had a prompt in llama-server."""
    # in real time, so that the two prompts, about a second each, overlap whatever the machine's load
    upstream = sim("--parallel", "2", "-c", "8192", "-n", "100", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.kv_cells and d, what="its cache")

    def ask(word: str) -> int:
        prompt = " ".join(f"{word}{i}" for i in range(1500))  # about 3,000 tokens, nothing in common
        body = {"prompt": prompt, "max_tokens": 1}
        return httpx.post(gateway.url + "/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, ["left", "right"])) == [200, 200]
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.prefill_tokens_per_s and d,
                     what="a prefill speed")
    tokens, seconds = prompt_totals(upstream)
    per_slot = tokens / seconds
    assert doc.prefill_tokens_per_s is not None and doc.prefill_tokens_per_s > 1.5 * per_slot


def test_prompts_sent_to_llama_server_directly_do_not_move_the_speed_the_agent_measured(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "2", "-c", "8192", "-n", "100", "--speed", "20", "--metrics")
    gateway = agent("--upstream", upstream.url)
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.kv_cells and d, what="its cache")

    def ask(url: str, word: str) -> int:
        prompt = " ".join(f"{word}{i}" for i in range(800))  # about 1,600 tokens
        body = {"prompt": prompt, "max_tokens": 1}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).status_code

    assert ask(gateway.url, "mine") == 200
    measured = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.prefill_tokens_per_s and d,
                          what="a prefill speed")
    # two prompts side by side, past the agent: llama-server's counters move, the agent sent none of them
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(ask, [upstream.url] * 2, ["left", "right"])) == [200, 200]
    since = measured.updated_at_ms + 3000
    later = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.updated_at_ms > since and d,
                       what="heartbeats after them")
    assert later.prefill_tokens_per_s == measured.prefill_tokens_per_s
    assert later.prefill_depth == measured.prefill_depth
    # the agent's own next prompt is measured from there on
    assert ask(gateway.url, "again") == 200
    wait_until(lambda: (d := read_node(redis_url, "n1")) and d.prefill_depth != measured.prefill_depth,
               what="the next reading")


@pytest.mark.in_process
def test_a_server_in_the_agents_own_process_is_described_by_the_arguments_after_dashes(
    sim: SimFactory, agent: AgentFactory, redis_url: str
) -> None:
    upstream = sim("--parallel", "2", "-c", "8192", "--speed", "20")
    agent("--upstream", upstream.url, "--", "--parallel", "2", "-c", "8192", "--kv-unified")
    doc = wait_until(lambda: (d := read_node(redis_url, "n1")) and d.kv_cells and d, what="its cache")
    assert (doc.seq_ctx, doc.kv_unified, doc.kv_cells) == (4096, True, 8192)
