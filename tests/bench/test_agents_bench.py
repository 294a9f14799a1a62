"""``macpool bench agents``: the sessions it replays, its verdicts against the targets (which can fail), and
one tiny real run; and the placement bench's check against the best split."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import pytest

from macpool.bench import agents, placement
from macpool.bench.agent_sessions import (
    PATHS,
    REAL_FIRST_TURN_TOKENS,
    Floors,
    Shapes,
    Workload,
    plan,
    sim_prompt,
)
from macpool.sim import tokens
from macpool.sim.machine import load_preset
from node_agent import sizing
from node_agent.settings import AgentSettings
from tests.bench.conftest import run_bench

pytestmark = pytest.mark.timeout(600)


def test_sessions_are_coding_agent_turns_growing_by_turn() -> None:
    shapes = Shapes(agents.MODEL)
    lanes = plan(Workload(lanes=2, seed=3, claude_share=0.5, turns=(3, 3)), sessions_per_lane=2)
    sessions = [s for lane in lanes for s in lane]
    assert {s.client for s in sessions} == {"claude", "codex"}
    for session in sessions:
        requests = [shapes.request(session, n, run=0) for n in range(len(session.turns))]
        sizes = [tokens.count(sim_prompt(r.path, r.body)) for r in requests]
        # the first turn is the recorded one's size plus the task; each later one adds its tool's output
        extra = sizes[0] - REAL_FIRST_TURN_TOKENS[session.client]
        assert session.task_tokens - 50 <= extra <= session.task_tokens + 50, (session, sizes)
        growth = [b - a for a, b in itertools.pairwise(sizes)]
        assert all(g >= turn.tool_tokens for g, turn in zip(growth, session.turns[1:], strict=True)), sizes
        assert {r.path for r in requests} == {PATHS[session.client]}
        key = "x-claude-code-session-id" if session.client == "claude" else "session-id"
        assert len({r.headers[key] for r in requests}) == 1  # one session id for the whole session
        assert "tool" in str(requests[-1].body)  # later turns carry tool calls and their results
    # another run: other session ids, and prompts that share no cached prefix with this run's
    for session in sessions:
        this, other = (shapes.request(session, 0, run=run) for run in (0, 1))
        assert shapes.session_id(session, 0) != shapes.session_id(session, 1)
        a, b = (sim_prompt(r.path, r.body) for r in (this, other))
        assert tokens.common_prefix_tokens(a, b) < 1000


def test_the_pools_capacity_counts_each_mac_at_the_least_its_turns_cost() -> None:
    shapes = Shapes(agents.MODEL)
    lanes = plan(Workload(lanes=2, seed=3, turns=(4, 6)), sessions_per_lane=2)
    pool = agents.capacity(shapes, lanes)
    by_mac, work = pool["turns_per_min_by_mac"], pool["work_s_per_turn"]
    # the M4 Max and the M2 Ultra hold whole sessions; the M2 Ultra's steps are the quicker
    assert set(work) == {"m4max", "m2ultra"} and work["m2ultra"] < work["m4max"], pool
    assert by_mac["m2ultra"] == round(60 / work["m2ultra"], 2)
    # the M2 Pro (32K) can only start sessions that then move: at under a third of the M2 Ultra's prompt
    # speed, it saves less than a third of what the M2 Ultra completes
    assert 0 <= by_mac["m2pro"] < by_mac["m2ultra"] / 3, pool
    assert pool["turns_per_min"] == pytest.approx(sum(by_mac.values()), abs=0.02)
    # a turn's least work is its time alone less the weights' pass of each step, which a batch shares
    session = lanes[0][0]
    machine = load_preset(agents.FASTEST.preset)
    for floor in Floors(shapes, machine).of(session):
        assert 0 < floor.work_s < floor.turn_s
    # a move to a Mac that never served the session processes its history again
    later = Floors(shapes, machine)
    assert later.moved(session, 2).work_s > later.of(session)[2].work_s


def figures(ttft_p50: float, ttft_p99: float, turns: float, context_errors: int = 0) -> dict[str, Any]:
    return {"ttft_p50_s": ttft_p50, "ttft_p99_s": ttft_p99, "turns_per_min": turns,
            "context_errors": context_errors}


def test_the_macs_prompt_caches_are_the_ones_the_agent_gives_them() -> None:
    gb_per_gib, defaults = 1024**3 / 1e9, AgentSettings.model_fields
    for mac in agents.MACS:
        machine = load_preset(mac.preset)
        mib, _ = sizing.cache_ram(
            total_gb=machine.total_gb * gb_per_gib, weights_gb=machine.weights_gb * gb_per_gib,
            kv_gb=mac.cells * machine.kv_mb_per_token * 2**20 / 1e9,
            headroom_gb=defaults["headroom_gb"].default, reserve_gb=defaults["host_reserve_gb"].default)
        assert mac.cache_ram_mib == mib, mac.name


def test_targets_are_met_only_by_the_margins_the_issue_names() -> None:
    peers = {"nginx-sticky": figures(10.0, 100.0, 10.0), "litellm": figures(8.0, 200.0, 5.0, 3)}
    met = agents.targets({"macpool": figures(4.0, 20.0, 13.0)} | peers, None)
    assert all(entry["met"] for entry in met.values()), met
    assert met["ttft_p50_s"]["best_peer"] == "litellm" and met["ttft_p50_s"]["ratio"] == 2.0
    assert met["ttft_p99_s"]["best_peer"] == "nginx-sticky" and met["ttft_p99_s"]["ratio"] == 5.0
    missed = agents.targets({"macpool": figures(4.1, 21.0, 12.9, 1)} | peers, None)
    assert not any(entry["met"] for entry in missed.values()), missed
    lines = agents.verdicts({"targets": missed})
    assert len(lines) == 4 and all("MISSED" in line for line in lines)


def test_a_peer_that_completed_nothing_is_beaten_by_any_turn() -> None:
    routers = {"macpool": figures(4.0, 20.0, 1.0), "nginx-sticky": figures(9.0, 90.0, 0.0)}
    assert agents.targets(routers, None)["turns_per_min"] == {
        "target": 1.3, "best_peer": "nginx-sticky", "peer": 0.0, "macpool": 1.0, "ratio": None, "met": True}


def level(value: float, best_ratio: float | None) -> dict[str, Any]:
    runs = {} if best_ratio is None else {"macpool": {"best_ratio": best_ratio}}
    return {"level": value, "runs": runs | {"nginx": {"best_ratio": 1.0}}}


def test_placement_below_the_best_split_target_is_not_met() -> None:
    assert placement.check([level(0.5, 0.99), level(1, 0.98)])["met"]
    short = placement.check([level(0.5, 0.97), level(1, 1.02)])
    assert short == {"target": 0.98, "best_ratio": {"0.5": 0.97, "1": 1.02},
                     "met_by_level": {"0.5": False, "1": True}, "met": False}
    assert "NOT MET" in placement.verdict({"target": short})
    assert not placement.check([level(0.5, None)])["met"]  # a level macpool did not run
    assert not placement.check([])["met"]


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_agents_bench_tiny(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "agents", "--skip-install", "--routers", "macpool,nginx-least-conn",
                     "--sessions", "2", "--turns", "2-2", "--duration", "150", "--warmup", "20",
                     "--stagger", "5", "--speed", "20")
    assert set(data["routers"]) == {"macpool", "nginx-least-conn"}
    for name, r in data["routers"].items():
        assert {"ttft_p50_s", "ttft_p99_s", "turns_per_min", "context_errors", "cache_hit_ratio"} <= set(r)
        assert r["turns_measured"] > 0, (name, r)
    mine = data["routers"]["macpool"]
    assert mine["turns_completed"] > 0 and mine["context_errors"] == mine["other_errors"] == 0, mine
    assert 0 < mine["ttft_p50_s"] <= mine["ttft_p99_s"]
    assert 0 <= mine["cache_hit_ratio"] <= 1
    # each Mac's share of the measured window spent stepping: the sessions ran somewhere
    assert set(mine["busy_by_mac"]) == {mac.name for mac in agents.MACS}
    assert all(0 <= share <= 1 for share in mine["busy_by_mac"].values()), mine["busy_by_mac"]
    assert max(mine["busy_by_mac"].values()) > 0, mine["busy_by_mac"]
    # the second turn of a session finds its history in the slot that served the first
    turns = data["runs"][0]["turns"]
    assert any(t["turn"] == 1 and t["cached_tokens"] > 20_000 for t in turns), turns
    assert set(data["targets"]) == {"context_errors", "ttft_p50_s", "ttft_p99_s", "turns_per_min"}
    for key in ("ttft_p50_s", "ttft_p99_s", "turns_per_min"):
        entry = data["targets"][key]
        assert entry["best_peer"] == "nginx-least-conn" and isinstance(entry["met"], bool), entry
    bound = data["bounds"]
    assert bound["ttft_p50_s"] > 0 and bound["turns_per_min"] > 0
    assert bound["turns_per_min"] == min(bound["turns_per_min_paced"], bound["capacity"]["turns_per_min"])
