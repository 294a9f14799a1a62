"""The machine model is physical: the knee emerges from memory, moving with prompt length and wired limit."""

from __future__ import annotations

import pytest

from macpool.sim.engine import closed_loop
from macpool.sim.machine import Machine, MachineError, MemoryState, load_machine, load_preset, preset_names

LEVELS = range(2, 21, 2)


def knee(machine: Machine, prompt_tokens: int, max_tokens: int = 128) -> int:
    """The concurrency with the highest aggregate throughput."""
    results = [closed_loop(machine, n, prompt_tokens, max_tokens) for n in LEVELS]
    return max(results, key=lambda r: r.throughput_tok_s).concurrency


@pytest.fixture(scope="module")
def seed_box() -> Machine:
    return load_preset("m5max-128g-14b-q4")


def test_knee_moves_with_prompt_length(seed_box: Machine) -> None:
    short, seed, long = (knee(seed_box, p) for p in (2048, 4096, 8192))
    assert short > seed > long


def test_bigger_wired_limit_holds_more(seed_box: Machine) -> None:
    roomy = seed_box.with_changes(wired_limit_gb=seed_box.wired_limit_gb * 2)
    assert knee(roomy, 4096) > knee(seed_box, 4096)


def test_throughput_collapses_past_the_wired_limit(seed_box: Machine) -> None:
    at_8 = closed_loop(seed_box, 8, 4096, 1024)
    at_16 = closed_loop(seed_box, 16, 4096, 1024)
    assert at_8.state == MemoryState.NEAR_CEILING
    assert at_16.state == MemoryState.COLLAPSED
    assert at_16.throughput_tok_s < at_8.throughput_tok_s / 2


def test_memory_states_and_penalty(seed_box: Machine) -> None:
    limit = seed_box.wired_limit_gb
    assert seed_box.state(0.5 * limit) == MemoryState.HEALTHY
    assert seed_box.state(0.9 * limit) == MemoryState.NEAR_CEILING
    assert seed_box.state(limit + 1) == MemoryState.PAGING
    assert seed_box.state(limit + seed_box.collapse_overflow_gb) == MemoryState.COLLAPSED
    assert seed_box.paging_penalty(limit) == 1.0
    assert 1.0 < seed_box.paging_penalty(limit + 1) < seed_box.paging_penalty(limit + 5)


def test_every_preset_loads_and_has_a_knee() -> None:
    assert {"m5max-128g-14b-q4", "m2pro-32g-8b-q4", "m4max-64g-32b-q4"} <= set(preset_names())
    for name in preset_names():
        machine = load_preset(name)
        assert machine.name == name
        assert machine.per_request_gb() > 0
        if not machine.kv_at_start:  # memory flat under load: no memory knee (test_sim_memory_modes.py)
            assert 1 < knee(machine, machine.typical_prompt_tokens) < max(LEVELS)


def test_bad_machine_descriptions(tmp_path: object) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    with pytest.raises(MachineError, match="unknown preset"):
        load_preset("nope")
    broken = folder / "m.json"
    broken.write_text('{"name": "x"')
    with pytest.raises(MachineError, match="not valid JSON"):
        load_machine(broken)
    broken.write_text('{"name": "x"}')
    with pytest.raises(MachineError, match="model_name"):
        load_machine(broken)
