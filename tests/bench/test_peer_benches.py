"""Smoke tests of the benches against the peers, nginx and LiteLLM: tiny parameters, real processes, JSON keys
and sane values (a file of their own: each takes half a minute, and pytest-xdist runs files side by side).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from macpool.bench import peers, placement
from tests.bench.conftest import run_bench
from tests.bench.test_perf_benches import positive

pytestmark = pytest.mark.timeout(600)
needs_peers = pytest.mark.skipif(
    shutil.which("nginx") is None or not (peers.VENV / "bin" / "litellm").exists(),
    reason="peers not installed (run `macpool bench peers` once to install nginx and LiteLLM)",
)


def test_peers_fails_clearly_without_a_peer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(peers, "VENV", tmp_path / "no-venv")
    with pytest.raises(peers.PeerError, match="LiteLLM is not installed"):
        peers.ensure_litellm(install=False)


@needs_peers
def test_peers(tmp_path: Path) -> None:
    data = run_bench(
        tmp_path,
        "peers",
        "--skip-install",
        "--levels",
        "2",
        "--duration",
        "1",
        "--warmup",
        "0.3",
        "--streams",
        "4",
        "--rounds",
        "2",
    )
    row = data["ttft"]["2"]
    for name in ("direct", "macpool", "nginx", "litellm"):
        assert row[name]["ok"] > 0, (name, row[name])
    assert len(row["rounds"]) == 2  # the paths took turns twice; each round's figures are kept
    for turn in row["rounds"]:
        assert set(turn) == {"macpool", "nginx", "litellm", "litellm_over_macpool"}, turn
    for name in ("macpool", "nginx", "litellm"):
        assert positive(data["relay"][name]["chunks_per_s_wall"]), (name, data["relay"])
    assert "macpool_over_nginx_relay" in data["ratios"]


@needs_peers
def test_placement(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "placement", "--skip-install", "--levels", "0.25", "--duration", "8",
                     "--light-duration", "6", "--speed", "4", "--prompt-tokens", "128", "--max-tokens", "32")
    assert set(data["knees"]) == {"m5max", "m2pro", "m4max"} and positive(data["knee_sum_tok_s"])
    (level,) = data["levels"]
    assert level["duration_s"] == data["conditions"]["light_duration_s"] == 6  # below 1x
    assert set(level["runs"]) == {"macpool", "litellm", "nginx", "macpool least-utilised"}
    for name, run in level["runs"].items():
        # A peer's own errors are what the bench reports about that peer; only macpool's runs
        # must be free of them.
        assert run["completed"] > 0, (name, run)
        if name.startswith("macpool"):
            assert run["errors_non_503"] == 0 and run["unserved_clients"] == 0, (name, run)
        assert sum(run["completed_by_mac"].values()) >= run["completed"] > 0, (name, run)
        assert run["best_ratio"] == pytest.approx(run["throughput_tok_s"] / level["best_tok_s"], abs=1e-3)
    # every Mac measured at each concurrency up to the level's clients, and at its cap (its knee)
    for mac in data["macs"]:
        curve = data["curves"][mac["name"]]
        below_cap = range(1, min(mac["cap"] - 1, level["clients"]) + 1)
        assert list(curve) == [*(str(k) for k in below_cap), str(mac["cap"])], (mac, curve)
        assert curve[str(mac["cap"])] == data["knees"][mac["name"]]
        assert all(positive(tok_s) for tok_s in curve.values()), (mac, curve)
    assert set(data["ttft_p50_alone_s"]) == {mac["name"] for mac in data["macs"]}
    assert sum(level["best_split"].values()) <= level["clients"]
    assert 0 < level["best_tok_s"] <= sum(max(curve.values()) for curve in data["curves"].values())
    mine, target = level["runs"]["macpool"]["best_ratio"], data["target"]
    assert target["target"] == 0.98 and target["best_ratio"] == {"0.25": mine}
    assert target["met"] == (mine >= 0.98)


def test_best_split_is_the_best_placement_of_that_many_clients() -> None:
    curves = {"fast": {1: 10.0, 2: 18.0, 3: 20.0}, "slow": {1: 5.0, 2: 9.0}}
    assert placement.best_split(curves, 1) == (10.0, {"fast": 1, "slow": 0})
    # the third client adds more on the slow Mac than on the fast one's saturating batch
    assert placement.best_split(curves, 3) == (23.0, {"fast": 2, "slow": 1})
    # more clients than slots: every Mac at its cap, the others wait
    assert placement.best_split(curves, 10) == (29.0, {"fast": 3, "slow": 2})
    # a Mac slower in a fuller batch is held at its best concurrency
    assert placement.best_split({"paging": {1: 10.0, 2: 8.0}}, 2) == (10.0, {"paging": 1})
