"""``macpool bench prefill``: how long the real llama-server takes to read a coding agent's turn.

A recorded turn (tests/fixtures/clients/: every request Claude Code or Codex sent for a one-line task) is
sent again, its first model request as recorded but not streamed and asking for one token, to llama-server
serving the tiny model on one thread (``-t 1 --ctx-size 65536 -np 1``). Before each run the slot's cache is
erased, so every run reads the whole prompt. Reported per run: the prompt tokens and the prefill seconds,
from llama-server's own counters (``/metrics``: ``prompt_tokens_total``, ``prompt_seconds_total``), and
their median; ``--json FILE`` writes them too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from macpool.dev import tiny_model
from macpool.dev.llama_build import find_llama_server
from macpool.dev.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]  # the checkout: macpool/<package>/<module>.py
TURNS = {
    "claude": ROOT / "tests" / "fixtures" / "clients" / "claude-code-turn.json",
    "codex": ROOT / "tests" / "fixtures" / "clients" / "codex-turn.json",
}
START_TIMEOUT_S = 60.0


def first_model_request(turn: Path) -> tuple[str, dict[str, Any]]:
    """The path and body of the turn's first model request, not streamed and asking for one token."""
    for request in json.loads(turn.read_text())["requests"]:
        body: dict[str, Any] = request["body"]
        if request["path"] == "/v1/messages":
            return request["path"], {**body, "stream": False, "max_tokens": 1}
        if request["path"] == "/v1/responses":
            return request["path"], {**body, "stream": False, "max_output_tokens": 1}
    raise SystemExit(f"{turn}: no /v1/messages or /v1/responses request")


def counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"llamacpp:{name} "):
            return float(line.split()[1])
    raise SystemExit(f"llama-server's /metrics has no llamacpp:{name}")


def wait_healthy(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"llama-server exited ({server.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f}s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="macpool bench prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turn", default="claude", help="claude, codex, or a recorded turn's file")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the runs here")
    args = parser.parse_args(argv)
    binary = find_llama_server()
    if binary is None:
        raise SystemExit("llama-server not built: run `macpool dev build-llama-server`")
    path, body = first_model_request(TURNS.get(args.turn, Path(args.turn)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="macpool-prefill-") as slots:
        model = tiny_model.ensure("tiny")
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1",
                   "--ctx-size", "65536", "-np", "1", "--metrics", "--slot-save-path", slots]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(url, server)
            runs = [_run(url, path, body, run) for run in range(1, args.runs + 1)]
        finally:
            server.terminate()
            server.wait(10)
    median = statistics.median(seconds for _, seconds in runs)
    print(f"median {median:.2f} s over {len(runs)} runs")
    if args.json:
        document = {"turn": args.turn, "path": path, "median_s": round(median, 3),
                    "runs": [{"prompt_tokens": tokens, "prefill_s": round(s, 3)} for tokens, s in runs]}
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    return 0


def _run(url: str, path: str, body: dict[str, Any], run: int) -> tuple[int, float]:
    httpx.post(url + "/slots/0", params={"action": "erase"}, timeout=10).raise_for_status()
    tokens, seconds = counter(url, "prompt_tokens_total"), counter(url, "prompt_seconds_total")
    httpx.post(url + path, json=body, timeout=600).raise_for_status()
    tokens = counter(url, "prompt_tokens_total") - tokens
    seconds = counter(url, "prompt_seconds_total") - seconds
    print(f"run {run}: {tokens:.0f} prompt tokens in {seconds:.2f} s", flush=True)
    return round(tokens), seconds
