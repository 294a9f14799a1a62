"""What a node says it can hold, against the real llama-server: each heartbeat's KV cache (``seq_ctx``,
``kv_unified``, ``kv_cells``, ``n_predict``), the cells held now and the measured prefill speed.

The truth is llama-server's own: it logs the slots, each slot's context and whether the cache is unified
(``load_model: initializing, n_slots = 4, n_ctx_slot = 16384, kv_unified = 'false'``) and, at ``-lv 4``, the
cells of its context (``llama_context: n_ctx = 65536``). /props tells the first two only, which is why the
agent reads llama-server's arguments; these tests hold what it makes of them to what llama-server built.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from macpool.contract import NodeDoc
from macpool.dev import tiny_model
from macpool.dev.procs import macpool_argv
from macpool.dev.stack import Proc, Stack, free_port
from tests.node_agent.helpers import read_node

from .conftest import RealSetup, real_setup, wait_until

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

# (llama-server's arguments, its environment): the shapes a Mac's llama-server is started with
ATTACHED: dict[str, tuple[list[str], dict[str, str]]] = {
    "defaults": ([], {}),  # --parallel auto: 4 slots over one cache of the training context (64K)
    "split": (["--parallel", "4", "-c", "65536", "-n", "300"], {}),
    "capped": (["--parallel", "4", "--kv-unified", "--kv-unified-per-slot", "8192"], {}),
    "environment": (["-kvu"], {"LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_CTX_SIZE": "8192"}),
}


@dataclass(frozen=True)
class Built:
    """What llama-server's log says it built."""

    slots: int
    n_ctx_slot: int
    unified: bool
    cells: int


def built(log: Path) -> Built:
    text = log.read_text()
    init = re.search(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'", text)
    cells = re.search(r"llama_context: n_ctx\s+= (\d+)", text)
    assert init and cells, f"{log}: no load_model or llama_context lines"
    return Built(int(init.group(1)), int(init.group(2)), init.group(3) == "true", int(cells.group(1)))


def sample(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, re.M)
    assert found, name
    return float(found.group(1))


def serving_doc(redis_url: str, node_id: str) -> NodeDoc:
    """The node's document once it is ready and its KV cache known."""
    ready = wait_until(lambda: (d := read_node(redis_url, node_id)) and d.state == "ready" and d.kv_cells
                       and d, 60, f"{node_id} ready with its KV cache")
    doc: NodeDoc = ready
    return doc


def llama_server(stack: Stack, setup: RealSetup, name: str, args: list[str], env: dict[str, str]) -> Proc:
    port = free_port()
    argv = [str(setup.binary), "-m", str(setup.model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "--metrics", "-lv", "4", *args]
    return stack.spawn(name, argv, port, env=env, timeout=60)


@pytest.fixture(scope="module")
def setup(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealSetup]:
    yield real_setup(redis_server, tmp_path_factory, "kv")


def test_attached_each_shape_is_what_llama_server_built(setup: RealSetup, redis_server: str) -> None:
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        servers = {name: llama_server(stack, setup, f"llama-{name}", *shape)
                   for name, shape in ATTACHED.items()}
        for name, server in servers.items():
            stack.agent(f"agent-{name}", server.url, redis_server, name, "--heartbeat-interval", "0.3",
                        "--model", str(setup.model), "--memory-probe", "linux", ready="/status", wait=False)
        for name, server in servers.items():
            doc = serving_doc(redis_server, name)
            assert server.log_path is not None
            truth = built(server.log_path)
            seen = (doc.total_slots, doc.seq_ctx, doc.kv_unified, doc.kv_cells)
            assert seen == (truth.slots, truth.n_ctx_slot, truth.unified, truth.cells), name
            assert doc.ctx_per_slot == doc.seq_ctx
            assert doc.n_predict == (300 if name == "split" else -1), name
            # the memory term counts a slot's share of the cells: a shared cache is not a cache per request
            share = truth.cells // truth.slots
            kv_per_token = tiny_model.kv_bytes_per_token(setup.model)
            assert doc.memory.per_request_gb == pytest.approx(kv_per_token * share / 1e9 + 0.25, abs=1e-4)


def test_supervised_node_says_its_cache_what_it_holds_and_how_fast_it_prefills(
    setup: RealSetup, redis_server: str
) -> None:
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        agent = setup.agent(stack, redis_server, "supervised", 2, 8192, "--heartbeat-interval", "0.3",
                            llama_args=("-n", "200", "-lv", "4"))
        doc = serving_doc(redis_server, "supervised")
        truth = built(setup.logs / "llama-supervised.log")
        assert (doc.total_slots, doc.seq_ctx, doc.kv_unified, doc.kv_cells) == (2, 8192, False, 16384)
        assert (truth.slots, truth.n_ctx_slot, truth.unified, truth.cells) == (2, 8192, False, 16384)
        assert doc.n_predict == 200 and doc.kv_cells_used == 0 and doc.prefill_tokens_per_s is None

        # one long prompt (a byte a token with the tiny model), processed in full
        prompt = "".join(f"{i:05d} " for i in range(1000))
        body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
        answer = httpx.post(agent.url + "/v1/completions", json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        llama = httpx.get(agent.url + "/status", timeout=5).json()["llama_server"]["url"]
        slots = httpx.get(llama + "/slots", timeout=5).json()
        held = sum(slot.get("n_prompt_tokens", 0) for slot in slots)  # the idle slot keeps its prompt
        metrics = httpx.get(llama + "/metrics", timeout=5).text
        tokens, seconds = (sample(metrics, f"llamacpp:{name}") for name in ("prompt_tokens_total",
                                                                           "prompt_seconds_total"))
        assert held > 6000 and tokens > 6000

        doc = wait_until(lambda: (d := read_node(redis_server, "supervised")) and d.prefill_tokens_per_s
                         and d.kv_cells_used == held and d, 10, "the prefill speed and the cells held")
        # the first reading is the whole prompt over the time llama-server spent on it
        assert doc.prefill_tokens_per_s == pytest.approx(tokens / seconds, rel=0.01)
        assert agent.child.log_path is not None
        log = agent.child.log_path.read_text()
        assert ("llama-server's KV cache: 2 slots of 8192 tokens, each its own KV cells (16384 in all) (from "
                "the command line the agent started it with)") in log


def test_calibrate_sizes_prompts_by_the_tokenizer_and_keeps_to_the_shared_cells(
    setup: RealSetup, tmp_path: Path
) -> None:
    """llama-server's default layout over 8K cells: 4 slots, each of which may take all 8K. Prompts near the
    context, sized by the model's own tokenizer (3 tokens a space with the tiny model), fit it; and two at
    once would not fit the cells, so calibrate measures one."""
    with Stack(logs=setup.logs, keep_logs=True, stop_timeout=15) as stack:
        server = llama_server(stack, setup, "llama-calibrate", ["-c", "8192"], {})
        out = tmp_path / "cal.json"
        argv = macpool_argv("agent", "calibrate", "--upstream", server.url, "--levels", "1,2,3,4",
                            "--max-tokens", "8", "--window", "3", "--json", str(out))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "prompts of 8103 tokens (near the 8192 tokens a request may hold), 8 generated"
    assert re.fullmatch(r"levels above 1 left out: the 4 slots share 8192 KV cells \(its command line "
                        r"\(pid \d+\)\), room for 1 request of 8103 \+ 8 tokens", lines[1]), lines[1]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [row["concurrency"] for row in rows] == [1] and rows[0]["errors"] == 0, rows
    assert result["recommended_cap"] == 1
