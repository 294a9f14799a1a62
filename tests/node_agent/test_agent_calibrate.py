"""``macpool agent calibrate``: the throughput plateau, a latency bound, failures reported, and the cap
written to the agent's config (the memory knees: test_agent_calibrate_memory.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from macpool.dev.procs import macpool_argv
from node_agent import cli as agent_cli
from tests.conftest import Server

SimFactory = Callable[..., Server]


def run_calibrate(url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "agent.toml"
    config.write_text('redis_url = "redis://127.0.0.1:6379/0"\n')
    return subprocess.run(
        macpool_argv(
            "agent",
            "calibrate",
            "--upstream",
            url,
            "--json",
            str(tmp_path / "cal.json"),
            "--plot",
            str(tmp_path / "cal.png"),
            "--write-config",
            str(config),
            *args,
        ),
        capture_output=True,
        text=True,
        timeout=240,
    )


def calibrate(url: str, tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "cal.json"
    config = tmp_path / "agent.toml"
    done = run_calibrate(url, tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "recommended cap" in done.stdout and "why: " in done.stdout
    assert (tmp_path / "cal.png").stat().st_size > 0
    result: dict[str, object] = json.loads(out.read_text())
    assert f"calibrated_cap = {result['recommended_cap']}" in config.read_text()
    assert 'redis_url = "redis://127.0.0.1:6379/0"' in config.read_text()
    return result


# a 70B model on an M3 Ultra, memory allocated at start: prompt processing dominates, so throughput plateaus
# at a few requests while p50 keeps climbing, and memory never nears the wired limit
PLATEAU = ("--prompt-tokens", "2048", "--max-tokens", "64")
ULTRA = "m3ultra-192g-70b-q4"


@pytest.mark.slow
@pytest.mark.alone  # three sweeps that must agree within 1: other tests on the CPU make that a coin toss
def test_calibrate_stops_at_the_throughput_plateau_and_agrees_with_itself(
    sim: SimFactory, tmp_path: Path
) -> None:
    # 100x: the test runs apart from the rest of the suite, on a core of its own, so nothing slows the
    # simulator behind its clock
    upstream = sim("--parallel", "12", "-c", "98304", "--speed", "100", "--metrics", preset=ULTRA)
    caps = []
    for run in range(3):
        folder = tmp_path / str(run)
        folder.mkdir()
        result = calibrate(upstream.url, folder, *PLATEAU)
        assert result["limited_by"] == "throughput", result["reason"]
        assert result["memory_knee"] is None and result["throughput_knee"] == result["recommended_cap"]
        rows = result["rows"]
        assert isinstance(rows, list)
        cap = result["recommended_cap"]
        assert isinstance(cap, int) and 2 <= cap <= 6
        assert len(rows) <= cap + 3  # stops soon after the knee: the two levels that confirm it, at most one
        assert rows[-1]["p50_latency_s"] > 2 * rows[0]["p50_latency_s"]  # past the knee, p50 kept climbing
        caps.append(cap)
    assert max(caps) - min(caps) <= 1, caps


@pytest.mark.slow
def test_a_latency_bound_picks_the_largest_level_that_meets_it(sim: SimFactory, tmp_path: Path) -> None:
    upstream = sim("--parallel", "12", "-c", "98304", "--speed", "50", "--metrics", preset=ULTRA)
    result = calibrate(upstream.url, tmp_path, *PLATEAU, "--max-p50-ratio", "2", "--max-concurrency", "8")
    rows = result["rows"]
    assert isinstance(rows, list)
    meeting = [r["concurrency"] for r in rows if r["p50_ratio"] <= 2]
    assert result["recommended_cap"] == result["latency_cap"] == max(meeting)
    assert result["limited_by"] == "latency" and result["max_p50_ratio"] == 2
    assert rows[-1]["p50_ratio"] > 2 and rows[-2]["p50_ratio"] > 2  # two levels past the bound: it stopped


@pytest.mark.slow
@pytest.mark.alone  # the 2K knee is a throughput curve on the simulator's clock: other tests bend it
def test_prompts_near_the_context_find_a_lower_knee_than_short_ones(sim: SimFactory, tmp_path: Path) -> None:
    # the seed's Mac, 4 slots of 32K tokens: a coding agent's turn holds 12.8 GB of working set, a 2K one 1.6
    upstream = sim("--parallel", "4", "-c", str(4 * 32768), "--speed", "50", "--metrics")
    near, short = tmp_path / "near", tmp_path / "short"
    near.mkdir()
    short.mkdir()
    done = run_calibrate(upstream.url, near, "--max-tokens", "256", "--levels", "1,2,3,4")
    assert done.returncode == 0, done.stderr
    # 32,768 tokens a slot, less the output and a margin of 1% for the tokenizer's estimate
    said = "prompts of 32185 tokens (near the 32768 tokens a request may hold), 256 generated"
    assert done.stdout.splitlines()[0] == said
    at_context = json.loads((near / "cal.json").read_text())
    assert (at_context["prompt_tokens"], at_context["context"]) == (32185, 32768)
    assert all(row["errors"] == 0 for row in at_context["rows"])  # each prompt fits its slot
    at_2k = calibrate(upstream.url, short, "--prompt-tokens", "2048", "--max-tokens", "256",
                      "--levels", "1,2,3,4")
    assert at_context["recommended_cap"] == 1 and at_context["limited_by"] == "memory"
    assert isinstance(at_2k["recommended_cap"], int) and at_2k["recommended_cap"] >= 3


def test_a_first_level_past_the_memory_knee_says_so_and_exits_1(sim: SimFactory, tmp_path: Path) -> None:
    # 16 slots x 32K context of a 70B model: 160 GB of KV cache at start, past the 144 GB wired limit
    upstream = sim("--parallel", "16", "-c", "524288", "--speed", "200", "--metrics", preset=ULTRA)
    done = run_calibrate(upstream.url, tmp_path, "--prompt-tokens", "128", "--max-tokens", "8", "--window=3")
    assert done.returncode == 1, done.stderr
    assert "no safe concurrency" in done.stderr and "memory knee 0" in done.stderr
    assert "--parallel" in done.stderr and "--ctx-size" in done.stderr  # what to change
    assert "recommended cap" not in done.stdout
    assert "calibrated_cap" not in (tmp_path / "agent.toml").read_text()
    result = json.loads((tmp_path / "cal.json").read_text())
    assert result["recommended_cap"] == 0 and result["rows"][0]["state"] in ("paging", "collapsed")


def test_requests_failing_at_the_first_level_are_reported(sim: SimFactory, tmp_path: Path) -> None:
    # 4 slots of 512 tokens: every 1,024-token prompt is refused by the server
    upstream = sim("--parallel", "4", "-c", "2048", "--speed", "50", "--metrics")
    done = run_calibrate(upstream.url, tmp_path, "--prompt-tokens", "1024", "--max-tokens", "8")
    assert done.returncode == 1, done.stderr
    assert "requests failed" in done.stderr and "context" in done.stderr
    assert "Traceback" not in done.stderr
    result = json.loads((tmp_path / "cal.json").read_text())
    assert result["limited_by"] == "errors" and result["rows"][0]["errors"] > 0


def test_bad_figures_and_unwritable_outputs_fail_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # nothing listens at the upstream: each of these must be refused before the sweep tries to reach it
    # (--levels 0 would hang it, --step 0 raise from range(), an unwritable --json lose the results)
    broken = tmp_path / "broken.toml"
    broken.write_text("[agent\n")
    refused = "--upstream", "http://127.0.0.1:9"
    done = subprocess.run(macpool_argv("agent", "calibrate", *refused, "--levels", "0"),
                          capture_output=True, text=True, timeout=30)  # as a process: exit 2, one line
    assert done.returncode == 2 and "invalid levels.0=0" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "conc" not in done.stdout, done.stderr
    for args, said in ((["--step", "0"], "step='0'"),  # the others in this process
                       (["--write-config", str(broken)], "not a TOML file"),
                       (["--max-concurrency", "0"], "max_concurrency='0'"),
                       (["--max-p50-ratio", "1"], "max_p50_ratio='1'"), (["--max-ttft", "0"], "max_ttft='0'"),
                       (["--levels", "2,x"], "levels.1='x'"), (["--upstream", "127.0.0.1:9"], "http://"),
                       (["--json", str(tmp_path / "missing" / "cal.json")], "is not a writable directory"),
                       (["--write-config", str(tmp_path)], "write_config=")):
        assert agent_cli.main(["calibrate", *refused, *args]) == 2, args
        out, err = capsys.readouterr()
        assert said in err and len(err.strip().splitlines()) == 1, err
        assert "conc" not in out  # the sweep's table never started
    assert agent_cli.main(["calibrate", "--max-tokens", "8"]) == 2
    assert capsys.readouterr().err.strip() == "macpool agent: error: --upstream is required"
