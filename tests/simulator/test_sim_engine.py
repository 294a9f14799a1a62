"""The engine without HTTP: slots, the deferred queue, the prompt cache, cancellation."""

from __future__ import annotations

from macpool.sim import tokens
from macpool.sim.engine import Engine, Task
from macpool.sim.machine import load_preset


def engine(slots: int = 2, n_ctx: int = 4096) -> Engine:
    return Engine(load_preset("m5max-128g-14b-q4"), slots, n_ctx)


def task(text: str, n_predict: int = 4) -> Task:
    return Task(prompt=text, n_prompt=tokens.count(text), n_predict=n_predict)


def run_until_done(e: Engine, *tasks: Task) -> None:
    while not all(t.finished for t in tasks):
        e.step()


def test_tasks_beyond_the_slots_wait_in_fifo_order() -> None:
    e = engine(slots=1)
    first, second, third = task("a" * 40), task("b" * 40), task("c" * 40)
    for t in (first, second, third):
        e.submit(t)
    assert [t.slot is not None for t in (first, second, third)] == [True, False, False]
    assert list(e.deferred) == [[second], [third]]
    run_until_done(e, first)
    assert second.slot is not None and third.slot is None
    run_until_done(e, second, third)
    assert e.counters.completed == 3 and e.counters.max_concurrent == 1


def test_a_prompts_generations_start_together() -> None:
    e = engine(slots=2)
    busy, first, second = task("a" * 40, n_predict=8), task("b" * 40), task("b" * 40)
    e.submit(busy)
    e.submit(first, second)
    assert first.slot is None and second.slot is None  # one slot idle, two needed
    assert list(e.deferred) == [[first, second]]
    run_until_done(e, busy)
    assert first.slot is not None and second.slot is not None and first.slot is not second.slot
    assert first.t_start == second.t_start


def test_a_request_that_fits_overtakes_waiting_generations() -> None:
    e = engine(slots=2)
    busy, pair, single = task("a" * 40, n_predict=1000), [task("p" * 40), task("p" * 40)], task("s" * 40)
    for tasks in ([busy], pair, [single]):
        e.submit(*tasks)
    assert single.slot is not None and list(e.deferred) == [pair]


def test_a_freed_slot_offers_only_the_front_of_the_queue() -> None:
    e = engine(slots=2)
    first, second = task("a" * 40, n_predict=1000), task("b" * 40, n_predict=1000)
    pair, single = [task("p" * 40), task("p" * 40)], task("s" * 40)
    for tasks in ([first], [second], pair, [single]):
        e.submit(*tasks)
    assert list(e.deferred) == [pair, [single]]
    e.cancel(second)  # the pair still does not fit: to the back; the single waits beside the idle slot
    assert list(e.deferred) == [[single], pair] and single.slot is None
    e.cancel(first)
    assert single.slot is not None and list(e.deferred) == [pair]
    e.cancel(single)
    assert all(t.slot is not None for t in pair) and not e.deferred


def test_cancelling_a_waiting_request_empties_its_place_in_the_queue() -> None:
    e = engine(slots=2)
    busy, pair = task("a" * 40, n_predict=1000), [task("p" * 40), task("p" * 40)]
    e.submit(busy)
    e.submit(*pair)
    for t in pair:
        e.cancel(t)
    assert not e.deferred and e.counters.cancelled == 2


def test_prompt_cache_skips_the_shared_prefix() -> None:
    e = engine()
    text = "The same long system prompt. " * 40
    one = task(text)
    e.submit(one)
    run_until_done(e, one)
    again = task(text)
    e.submit(again)
    assert again.slot is one.slot
    assert again.n_cache == again.n_prompt - 1  # llama-server always evaluates the last prompt token
    # a follow-up turn: the old prompt plus the answer is cached
    follow = task(text + tokens.filler(4) + " and now something new, please")
    run_until_done(e, again)
    e.submit(follow)
    assert follow.n_cache >= one.n_prompt + 4 - 1
    assert e.counters.prompt_tokens_cached_total == again.n_cache


def test_slot_choice_prefers_the_longest_shared_prefix() -> None:
    e = engine()
    a, b = task("alpha " * 100), task("bravo " * 100)
    e.submit(a)
    e.submit(b)
    run_until_done(e, a, b)
    again_b = task("bravo " * 100 + "more")
    e.submit(again_b)
    assert again_b.slot is b.slot


def test_cancel_frees_the_slot_and_admits_the_next() -> None:
    e = engine(slots=1)
    running, waiting = task("x" * 400, n_predict=1000), task("y" * 40)
    e.submit(running)
    e.submit(waiting)
    e.step()
    e.cancel(running)
    assert running.cancelled and waiting.slot is not None
    assert e.counters.cancelled == 1
    e.cancel(running)  # idempotent
    assert e.counters.cancelled == 1


def test_generation_stops_at_the_context() -> None:
    e = engine(slots=1, n_ctx=64)
    t = task("z" * 200, n_predict=1000)  # 50 prompt tokens, 14 left
    e.submit(t)
    run_until_done(e, t)
    assert t.finish_reason == "length" and t.n_decoded == 14


def test_memory_grows_with_tokens_held() -> None:
    e = engine()
    idle = e.pinned_gb()
    t = task("w" * 4000, n_predict=50)
    e.submit(t)
    e.step()
    mid = e.pinned_gb()
    run_until_done(e, t)
    assert idle < mid
    assert e.pinned_gb() == idle  # a finished sequence no longer pins memory
    assert e.counters.peak_pinned_gb > mid


def test_a_prompts_generations_share_one_prefill() -> None:
    # llama-server prefills the prompt once, in the parent's slot, and copies that state to the n - 1 children
    text = tokens.make_prompt(3000)
    alone, together = engine(slots=4), engine(slots=4)
    single, group = task(text, n_predict=2), [task(text, n_predict=2) for _ in range(4)]
    alone.submit(single)
    together.submit(*group)
    run_until_done(alone, single)
    run_until_done(together, *group)
    assert [t.t_prompt_done for t in group] == [single.t_prompt_done] * 4  # not 4x the prefill
    assert [t.n_past for t in group] == [single.n_prompt] * 4  # each decodes on from the whole prompt
    assert all(t.timings() == group[0].timings() for t in group)  # the children repeat the parent's
    assert group[0].timings()["prompt_n"] == single.n_prompt
    assert together.counters.prompt_tokens_total == alone.counters.prompt_tokens_total == single.n_prompt
    assert together.counters.n_decode_total == alone.counters.n_decode_total


def test_children_wait_for_the_prefill_and_start_in_its_last_step() -> None:
    e = engine(slots=2)
    parent, child = task(tokens.make_prompt(3000)), task(tokens.make_prompt(3000))
    e.submit(parent, child)
    assert e.step() == []  # the first 2,048 prompt tokens, all the parent's
    assert (parent.n_past, child.n_past) == (2048, 0)
    assert e.pinned_gb() == e.machine.fixed_gb() + e.machine.sequence_gb(2048) + e.machine.sequence_gb(0)
    assert e.step() == [parent, child]  # the rest of the prompt; both sample their first token from it
    assert (parent.n_decoded, child.n_decoded) == (1, 1)
    assert e.pinned_gb() == e.machine.fixed_gb() + 2 * e.machine.sequence_gb(3001)  # each holds its own KV


def test_a_child_prefills_for_the_others_when_the_parent_is_cancelled() -> None:
    e = engine(slots=3)
    parent, *children = [task(tokens.make_prompt(3000)) for _ in range(3)]
    e.submit(parent, *children)
    e.step()
    e.cancel(parent)
    run_until_done(e, *children)
    assert all(t.finish_reason == "length" for t in children)
    assert children[0].timings() == children[1].timings()
    assert children[0].timings()["prompt_n"] == 3000


def test_children_take_the_lowest_idle_slots_and_keep_no_cache() -> None:
    # llama-server: the parent's slot is chosen by cached prefix, the children get the lowest-numbered idle
    # ones (get_free_slots) and clear them when they end (the parent's cache is enough)
    e = engine(slots=3)
    text = "The same long system prompt. " * 40
    a, b = task(text), task("Something else entirely. " * 40)
    e.submit(a)
    run_until_done(e, a)
    e.submit(b)
    run_until_done(e, b)
    # never-used slots tie as least recently used, and llama-server takes the last of them
    assert (a.slot, b.slot) == (e.slots[2], e.slots[1])
    parent, child = task(text), task(text)
    e.submit(parent, child)
    assert (parent.slot, child.slot) == (e.slots[2], e.slots[0])
    run_until_done(e, parent, child)
    assert child.n_cache == parent.n_cache == parent.n_prompt - 1
    assert e.slots[2].cached.startswith(text) and e.slots[0].cached == ""


def test_a_pooled_task_processes_its_prompt_from_scratch_and_generates_nothing() -> None:
    # embeddings and rerank: llama-server's stateless tasks reuse no cache and sample no token
    e = engine(slots=1)
    text = "the same words again " * 20
    first = task(text)
    e.submit(first)
    run_until_done(e, first)
    pooled = Task(prompt=text, n_prompt=tokens.count(text), n_predict=0, pooled=True)
    e.submit(pooled)
    assert pooled.n_cache == 0 and pooled.n_past == 0  # the slot holds the whole text: none of it is reused
    run_until_done(e, pooled)
    assert (pooled.n_decoded, pooled.finish_reason) == (0, "stop")
    assert e.slots[0].task is None and e.counters.tokens_predicted_total == first.n_decoded
    assert e.counters.prompt_tokens_total == first.n_prompt + pooled.n_prompt
