"""Long prompts on the coding presets: prefill, the prompt caches, a unified KV cache's cells."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from macpool.sim import tokens
from macpool.sim.cli import parse_settings
from macpool.sim.engine import CONTEXT_EXCEEDED, Engine, Task
from macpool.sim.machine import load_preset
from macpool.sim.settings import Resolved, SimSettings
from tests.conftest import Server

M2PRO = "m2pro-32g-coder30b-q4"  # 4 slots over 32K unified cells
M4MAX = "m4max-64g-coder30b-q4"  # 4 slots over 128K unified cells
ULTRA = "m2ultra-192g-coder30b-q4"  # 8 slots of 64K each


def served(preset: str, **flags: Any) -> Engine:
    """The engine ``macpool sim --preset PRESET`` with these settings starts."""
    machine = load_preset(preset)
    resolved = Resolved(SimSettings(preset=preset, **flags), machine)
    return Engine(machine, resolved.n_slots, resolved.n_ctx_slot, resolved.options)


def task(text: str, n_predict: int = 4) -> Task:
    return Task(prompt=text, n_prompt=tokens.count(text), n_predict=n_predict)


def run(e: Engine, *tasks: Task) -> None:
    for t in tasks:
        if t.slot is None and not t.finished and all(t not in group for group in e.deferred):
            e.submit(t)
    while not all(t.finished for t in tasks):
        e.step()


def test_prefill_time_grows_with_the_uncached_tokens_and_their_depth() -> None:
    seconds = {}
    for n in (5_000, 10_000, 20_000, 40_000):
        t = task(tokens.make_prompt(n, salt=str(n)), n_predict=1)
        run(served(M4MAX), t)
        seconds[n] = t.prompt_ms / 1000
    assert seconds[5_000] < seconds[10_000] < seconds[20_000] < seconds[40_000]
    # attention: a token deep in a prompt costs more than one near its start
    assert seconds[40_000] > 2.5 * seconds[20_000]
    assert 20 < seconds[20_000] < 40  # an M4 Max's tens of seconds for a coding agent's cold turn


def test_the_next_turn_prefills_only_what_is_new() -> None:
    e = served(M4MAX)
    history = tokens.make_prompt(25_000, salt="session")
    first = task(history, n_predict=200)
    run(e, first)
    # the agent sends the whole history again: its prompt, the answer, then a tool's result
    turn = task(history + tokens.filler(200) + tokens.make_prompt(1_000, salt="tool result"), n_predict=10)
    run(e, turn)
    assert turn.slot is first.slot
    timings = turn.timings()
    assert timings["cache_n"] >= 25_200 - 1 and timings["cache_n"] + timings["prompt_n"] == turn.n_prompt
    assert timings["prompt_n"] <= 1_001
    assert turn.prompt_ms < first.prompt_ms / 10
    cold = task(turn.prompt, n_predict=10)
    run(served(M4MAX), cold)  # the same turn on a Mac that does not hold the history
    assert cold.timings()["cache_n"] == 0 and cold.prompt_ms > 10 * turn.prompt_ms


def the_same_prompt_after_two_others(e: Engine) -> list[Task]:
    """A, B and C (unrelated prompts) one after the other on two slots, then A's next turn."""
    alpha = tokens.make_prompt(2_000, salt="alpha")
    tasks = [task(alpha), task(tokens.make_prompt(2_000, salt="bravo")),
             task(tokens.make_prompt(2_000, salt="charlie")), task(alpha + " and more")]
    for t in tasks:
        run(e, t)
    return tasks


def test_the_prompt_cache_moves_a_prompt_to_another_slot() -> None:
    # llama-server: each slot keeps its last prompt; when C takes A's slot, A's prompt is already in the
    # prompt cache (saved as B started), and A's next turn restores it into the slot it lands on
    a, b, c, again = the_same_prompt_after_two_others(served(ULTRA, parallel=2, ctx_size=2 * 8192))
    assert [t.slot.id for t in (a, b, c, again) if t.slot] == [1, 0, 1, 0]
    assert again.n_cache >= a.n_prompt and again.timings()["prompt_n"] <= 3
    without = served(ULTRA, parallel=2, ctx_size=2 * 8192, cache_ram=0)
    again = the_same_prompt_after_two_others(without)[-1]
    assert again.slot is not None and again.slot.id == 0 and again.n_cache == 0


def test_a_restored_prompt_costs_its_copy() -> None:
    e = served(ULTRA, parallel=2, ctx_size=2 * 32_768)
    restored = the_same_prompt_after_two_others(e)[-1]
    e0 = served(ULTRA, parallel=2, ctx_size=2 * 32_768, cache_ram=0)
    again = the_same_prompt_after_two_others(e0)[-1]
    assert e.counters.prompt_cache_restores == 1 and e0.counters.prompt_cache_restores == 0
    # the copy into the slot holds up the next step: the restored turn's prompt time includes it
    assert restored.prompt_ms / 1000 >= e.machine.state_copy_seconds(restored.n_cache) > 0
    assert restored.prompt_ms < again.prompt_ms / 5  # still far cheaper than processing the prompt again


def test_a_unified_cache_clears_idle_slots_as_a_task_starts() -> None:
    e = served(M2PRO)
    a = task(tokens.make_prompt(8_000, salt="a"), n_predict=50)
    run(e, a)
    assert a.slot is not None and e.cells_used() == tokens.count(a.slot.cached) == a.held
    b = task(tokens.make_prompt(8_000, salt="b"), n_predict=50)
    e.submit(b)
    assert a.slot.cached == "" and e.cells_used() == 0  # saved to the prompt cache, its cells given back
    run(e, b)
    again = task(a.prompt + tokens.filler(50) + " next", n_predict=5)
    run(e, again)
    assert again.slot is not a.slot and again.n_cache >= a.held - 1
    assert e.counters.prompt_cache_restores == 1


def test_one_sequence_may_take_the_whole_unified_context() -> None:
    e = served(M2PRO)
    lone = task(tokens.make_prompt(30_000, salt="big"), n_predict=5_000)
    run(e, lone)
    assert lone.answered and lone.finish_reason == "length" and lone.held >= 32_767


def test_unified_cells_bound_concurrent_long_requests() -> None:
    e = served(M2PRO)
    two = [task(tokens.make_prompt(12_000, salt=f"fits {i}"), n_predict=500) for i in range(2)]
    run(e, *two)
    assert all(t.answered for t in two)  # 25K cells of 32K
    three = [task(tokens.make_prompt(12_000, salt=f"too many {i}"), n_predict=500) for i in range(3)]
    run(e, *three)
    # 36K cells wanted: when the pool runs dry, llama-server fails every running task, not only the last
    assert [t.error for t in three] == [CONTEXT_EXCEEDED] * 3
    assert all(s.task is None and s.cached == "" for s in e.slots if s in [t.slot for t in three])
    assert e.counters.failed == 3 and e.cells_used() == 0
    after = task(tokens.make_prompt(12_000, salt="after"), n_predict=10)
    run(e, after)
    assert after.answered


def test_idle_slots_give_their_cells_back_when_a_sequence_needs_them() -> None:
    e = served(M2PRO, cache_idle_slots=False)  # idle slots keep their prompts' cells
    a = task(tokens.make_prompt(20_000, salt="a"), n_predict=10)
    run(e, a)
    assert a.slot is not None and e.cells_used() == a.held
    b = task(tokens.make_prompt(20_000, salt="b"), n_predict=10)
    run(e, b)
    assert b.answered and a.slot.cached == ""


def test_a_long_prefill_slows_every_other_stream() -> None:
    e = served(M4MAX)
    talker = task(tokens.make_prompt(1_000, salt="talker"), n_predict=5_000)
    e.submit(talker)
    while talker.n_decoded < 10:
        e.step()

    def pace(steps: int) -> float:
        start, done = e.sim_time, talker.n_decoded
        for _ in range(steps):
            e.step()
        return (e.sim_time - start) / (talker.n_decoded - done)

    alone = pace(20)
    agent = task(tokens.make_prompt(30_000, salt="agent"))
    e.submit(agent)
    during = pace(5)
    assert agent.prefilling and during > 50 * alone  # a token per 2,048-token prompt chunk
    while agent.prefilling:
        e.step()
    assert pace(20) < 1.5 * alone + 0.001  # and back to its pace (now beside a second stream)


def test_coder_presets_follow_the_reference_measurements() -> None:
    # benches/mac-m2-ultra/mac-m2-ultra.md in llama.cpp (build 7948): Qwen3-Coder-30B-A3B Q8_0 on an M2 Ultra,
    # pp2048 and tg32 at depth d. Prefill keeps its ratios to depth 0 whatever the weights' quantization; the
    # time a decoded token adds per token of context is the f16 KV cache's, the same at Q4 on the same chip
    ultra = load_preset(ULTRA)
    pp2048 = {0: 2453.11, 4096: 1569.46, 8192: 1145.51, 16384: 741.04, 32768: 431.31}
    tg32 = {0: 78.97, 4096: 71.18, 8192: 65.11, 16384: 56.87, 32768: 45.26}

    def pp(depth: int) -> float:
        return 2048 / ultra.step_seconds([], [(depth, 2048)], 0.0)

    def ms_per_token(depth: int) -> float:
        return 1000 * ultra.step_seconds([depth], [], 0.0)

    for depth in pp2048:
        assert abs(pp(depth) / pp(0) - pp2048[depth] / pp2048[0]) < 0.03
        added, measured = ms_per_token(depth) - ms_per_token(0), 1000 / tg32[depth] - 1000 / tg32[0]
        assert abs(added - measured) < 0.1 * measured + 0.2


@pytest.mark.parametrize(("flags", "cells", "n_ctx"), [
    ((), 32_768, 32_768),  # the preset: llama-server's auto, one pool
    (("-np", "4", "-c", "32768"), 32_768, 8_192),  # explicit slots: a stream each
    (("-np", "2", "-kvu", "-c", "1048576"), 1_048_576, 262_144),  # capped at the model's training context
    (("-np", "-1", "--kv-unified-per-slot", "4096"), 16_384, 4_096),  # no -c: slots x the cap
])
def test_the_flags_shape_the_cells_and_a_sequences_context(
    flags: tuple[str, ...], cells: int, n_ctx: int
) -> None:
    settings, _ = parse_settings(["--preset", M2PRO, *flags])
    resolved = Resolved(settings, load_preset(M2PRO))
    assert (resolved.n_cells, resolved.n_ctx_slot) == (cells, n_ctx)


@pytest.mark.in_process
def test_a_messages_stream_out_of_cells_ends_with_an_error_event(sim: Callable[..., Server]) -> None:
    server = sim("--parallel", "-1", "-c", "2048", "--speed", "5")
    prompt = tokens.make_prompt(900)
    body = {"model": "m", "max_tokens": 600, "messages": [{"role": "user", "content": prompt}]}

    def streamed() -> list[str]:
        url = server.url + "/v1/messages"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as reply:
            return [line for line in reply.iter_lines() if line]

    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(streamed)
        whole = pool.submit(httpx.post, server.url + "/v1/messages", json={**body, "system": "x"}, timeout=60)
        lines, failed = stream.result(), whole.result()
    error = {"code": 500, "message": CONTEXT_EXCEEDED, "type": "server_error"}
    assert lines[-2:] == ["event: error", "data: " + json.dumps(error, separators=(",", ":"))]
    assert (failed.status_code, failed.json()) == (500, {"error": error})
    stats = httpx.get(server.url + "/sim/stats").json()
    memory = httpx.get(server.url + "/sim/memory").json()
    assert stats["failed"] == 2 and (memory["kv_unified"], memory["kv_cells"], memory["kv_cells_used"]) == (
        True, 2048, 0
    )


def named(text: str, slot: int, n_predict: int = 4) -> Task:
    t = task(text, n_predict)
    t.id_slot = slot
    return t


def test_a_new_session_takes_the_most_similar_idle_slot_unless_it_names_one() -> None:
    # two sessions of one coding agent share a long prefix (its instructions and tools); a third, new one
    # takes the idle slot most like it - a live session's, between turns - unless its request names a slot
    shared = tokens.make_prompt(6_000, salt="instructions")
    for name_slots in (False, True):
        e = served(ULTRA, parallel=4, ctx_size=4 * 16_384)
        a = task(shared + tokens.make_prompt(2_000, salt="a"))
        run(e, a)
        assert a.slot is not None
        new = task(shared + tokens.make_prompt(200, salt="new"))
        if name_slots:
            new.id_slot = (a.slot.id + 1) % 4
        run(e, new)
        again = task(a.prompt + tokens.filler(4) + tokens.make_prompt(500, salt="a's next turn"))
        if name_slots:
            again.id_slot = a.slot.id
        run(e, again)
        if name_slots:
            assert new.slot is not a.slot and again.slot is a.slot
            assert again.n_cache >= a.n_prompt  # its history still there
        else:
            assert new.slot is a.slot and new.n_cache >= 5_900  # it took a's slot for the prefix
            assert again.n_cache < a.n_prompt - 1_500  # a's history is gone: processed again


def test_a_named_busy_slot_defers_the_request_while_others_are_idle() -> None:
    e = served(ULTRA, parallel=4, ctx_size=4 * 8_192)
    long = named(tokens.make_prompt(1_000, salt="long"), 2, n_predict=200)
    e.submit(long)
    e.step()
    assert long.slot is not None and long.slot.id == 2
    waiting = named(tokens.make_prompt(500, salt="waiting"), 6)  # 6 wraps around to slot 2
    other = named(tokens.make_prompt(500, salt="other"), 1)
    e.submit(waiting)
    e.submit(other)  # a request behind it that names an idle slot starts at once
    assert waiting.slot is None and [waiting] in e.deferred
    assert other.slot is not None and other.slot.id == 1
    run(e, long)
    # the slot it named freed: it is the deferred task llama-server offers that slot first
    assert waiting.slot is not None and waiting.slot.id == 2


def test_a_named_slot_saves_a_prompt_it_does_not_share_and_takes_the_best_saved() -> None:
    e = served(ULTRA, parallel=2, ctx_size=2 * 16_384, cache_idle_slots=False)
    a = named(tokens.make_prompt(3_000, salt="a"), 0)
    b = named(tokens.make_prompt(3_000, salt="b"), 0)  # a's slot: a's prompt goes to the prompt cache
    run(e, a)
    run(e, b)
    again = named(a.prompt + " and more", 0)  # a again in the same slot: b's saved, a's restored
    run(e, again)
    assert again.slot is a.slot and again.n_cache >= a.n_prompt - 1
    assert e.counters.prompt_cache_restores == 1
    # an empty named slot takes nothing from the prompt cache (llama-server's share kept is 0/0 there)
    fresh = named(a.prompt + " once more", 1)
    run(e, fresh)
    assert fresh.slot is not None and fresh.slot.id == 1 and fresh.n_cache == 0
