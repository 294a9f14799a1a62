"""``macpool agent calibrate`` finds the knee of two machine descriptions, and ``agent run`` picks it up."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from macpool.procs import macpool_argv
from node_agent import cli as agent_cli
from tests.conftest import Server

SimFactory = Callable[..., Server]


def calibrate(url: str, tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "cal.json"
    config = tmp_path / "agent.toml"
    config.write_text('redis_url = "redis://127.0.0.1:6379/0"\n')
    done = subprocess.run(
        macpool_argv(
            "agent",
            "calibrate",
            "--upstream",
            url,
            "--json",
            str(out),
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
    assert done.returncode == 0, done.stderr
    assert "recommended cap" in done.stdout
    assert (tmp_path / "cal.png").stat().st_size > 0
    result: dict[str, object] = json.loads(out.read_text())
    assert f"calibrated_cap = {result['recommended_cap']}" in config.read_text()
    assert 'redis_url = "redis://127.0.0.1:6379/0"' in config.read_text()
    return result


@pytest.mark.slow
def test_calibrate_recommends_8_on_the_seed_machine(sim: SimFactory, tmp_path: Path) -> None:
    upstream = sim("--parallel", "24", "--speed", "50", "--metrics")
    # 4,864 prompt + 256 generated tokens: the working set of the seed's 4K-prompt requests, in fewer steps
    result = calibrate(
        upstream.url,
        tmp_path,
        "--prompt-tokens",
        "4864",
        "--max-tokens",
        "256",
        "--levels",
        "1,4,8,9",
    )
    assert result["recommended_cap"] == 8
    assert result["limited_by"] == "memory"
    per_request = result["per_request_gb"]
    assert isinstance(per_request, float) and 2.3 < per_request < 2.9  # the preset's 2.625 GB
    rows = result["rows"]
    assert isinstance(rows, list) and rows[0]["concurrency"] == 1


@pytest.mark.slow
def test_calibrate_finds_the_knee_of_another_machine(sim: SimFactory, tmp_path: Path) -> None:
    # M2 Pro 32 GB, 8B model: 4.9 GB fixed + 1.06 GB per 2K-token request under 0.85 x 21.3 GB -> 12
    upstream = sim("--parallel", "16", "--speed", "20", "--metrics", preset="m2pro-32g-8b-q4")
    result = calibrate(
        upstream.url,
        tmp_path,
        "--prompt-tokens",
        "2048",
        "--max-tokens",
        "256",
        "--levels",
        "1,6,12,13",
    )
    assert result["recommended_cap"] == 12
    assert result["limited_by"] == "memory"


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
    assert done.returncode == 2 and "--levels" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "conc" not in done.stdout, done.stderr
    for args, said in ((["--step", "0"], "--step"),  # the others in this process
                       (["--write-config", str(broken)], "not a TOML file"),
                       (["--max-concurrency", "0"], "--max-concurrency"),
                       (["--json", str(tmp_path / "missing" / "cal.json")], "--json"),
                       (["--write-config", str(tmp_path)], "--write-config")):
        assert agent_cli.main(["calibrate", *refused, *args]) == 2, args
        out, err = capsys.readouterr()
        assert said in err and len(err.strip().splitlines()) == 1, err
        assert "conc" not in out  # the sweep's table never started
