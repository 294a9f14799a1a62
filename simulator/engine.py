"""The simulated llama-server core: slots, the deferred queue, batched steps on a virtual clock.

``Engine`` is synchronous and deterministic: ``step()`` runs one llama_decode-like step over every running
sequence (one new token each, plus up to ``n_batch`` prompt tokens of prefill) and advances the simulated
clock by what the machine model says that step costs. ``Runner`` drives an Engine from one asyncio task,
pacing simulated time against the wall clock at ``speed``; if Python falls behind, simulated time simply
advances more slowly (every reported figure is in simulated time).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from macpool.loops import wait_event
from simulator import tokens
from simulator.machine import STATE_ORDER, Machine, MemoryState

log = logging.getLogger("macpool.sim")

# llama-server only reuses a slot's cache when the shared prefix is at least this share of the new prompt
SLOT_PROMPT_SIMILARITY = 0.1
# falling further behind the wall clock than this re-anchors the clock instead of rushing to catch up
MAX_LAG_S = 0.1


@dataclass(eq=False)
class Task:
    """One request: its prompt, its limits, and its progress in simulated time."""

    prompt: str
    n_prompt: int
    n_predict: int
    finish_on_limit: str = "length"  # "stop" when the limit stands in for the model's end-of-sequence
    id: int = -1
    arrival: float = 0.0
    slot: Slot | None = None
    n_cache: int = 0
    n_past: int = 0  # prompt tokens in the KV cache (cached + processed)
    n_decoded: int = 0
    t_start: float = 0.0
    t_prompt_done: float = 0.0
    t_end: float = 0.0
    finished: bool = False
    cancelled: bool = False
    finish_reason: str = ""
    wake: asyncio.Event | None = field(default=None, repr=False)
    # set by a streaming consumer: tokens it has written out, so the engine never runs far ahead of them
    streaming: bool = False
    writing: bool = False  # inside a write: a client that does not read blocks here (flow control)
    n_sent: int = 0
    sent_at: float = 0.0  # wall time of the last write
    # llama-server's child task (n > 1): it waits while this parent prefills the prompt, then copies its state
    parent: Task | None = field(default=None, repr=False)
    # an embedding or rerank task (llama-server's stateless tasks): its prompt from scratch, no token after it
    pooled: bool = False

    @property
    def prefilling(self) -> bool:
        return self.n_past < self.n_prompt

    @property
    def prompt_ms(self) -> float:
        return (self.t_prompt_done - self.t_start) * 1000.0 if not self.prefilling else 0.0

    @property
    def predicted_ms(self) -> float:
        return (self.t_end - self.t_prompt_done) * 1000.0 if self.finished else 0.0

    def timings(self) -> dict[str, float | int]:
        prompt_n = self.n_prompt - self.n_cache
        prompt_ms = round(self.prompt_ms, 3)
        predicted_ms = round(self.predicted_ms, 3)
        return {
            "cache_n": self.n_cache,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000.0 * prompt_n / prompt_ms if prompt_ms else 0.0,
            "predicted_n": self.n_decoded,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / self.n_decoded if self.n_decoded else 0.0,
            "predicted_per_second": 1000.0 * self.n_decoded / predicted_ms if predicted_ms else 0.0,
        }


@dataclass(eq=False)
class Slot:
    id: int
    n_ctx: int
    cached: str = ""  # the text whose KV the slot still holds (prompt + generated of its last task)
    task: Task | None = None
    last_used: float = 0.0


@dataclass
class Counters:
    """llama-server's /metrics counters plus the simulator's own."""

    prompt_tokens_total: int = 0
    prompt_tokens_cached_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_total: int = 0
    tokens_predicted_seconds_total: float = 0.0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0
    n_tokens_max: int = 0
    # since the last /metrics read (llama-server's "bucket" for the two rate gauges)
    bucket_prompt_tokens: int = 0
    bucket_prompt_seconds: float = 0.0
    bucket_predicted_tokens: int = 0
    bucket_predicted_seconds: float = 0.0
    busy_s: float = 0.0  # simulated seconds spent stepping (the clock minus idle time)
    # simulator-only, reset by POST /sim/reset
    tokens_generated: int = 0
    completed: int = 0
    cancelled: int = 0
    max_concurrent: int = 0
    peak_pinned_gb: float = 0.0
    worst_state: str = MemoryState.HEALTHY.value


class Engine:
    """Slots, the deferred queue and the batched step, with no I/O."""

    def __init__(self, machine: Machine, n_slots: int, n_ctx_slot: int) -> None:
        self.machine = machine
        self.slots = [Slot(i, n_ctx_slot) for i in range(n_slots)]
        # llama-server's deferred tasks: each one prompt's generations (a task and its n_cmpl - 1 children)
        self.deferred: deque[list[Task]] = deque()
        self.running: list[Task] = []
        self.sim_time = 0.0
        self.external_gb = 0.0
        self.kv_cache_gb = machine.kv_cache_gb(n_slots, n_ctx_slot)
        self.counters = Counters()
        self._ids = itertools.count()

    # --- requests -----------------------------------------------------------------------------------------
    def submit(self, *tasks: Task) -> None:
        """One prompt's generations: they start together once enough slots are idle for all of them; the
        first prefills the prompt and the others start from its state."""
        for task in tasks:
            task.id = next(self._ids)
            task.arrival = self.sim_time
        self._launch(list(tasks))

    def cancel(self, task: Task) -> None:
        """Drop a task wherever it is (the client went away); frees its slot at once. Idempotent."""
        if task.finished:
            return
        task.finished = task.cancelled = True
        task.finish_reason = "cancelled"
        task.t_end = self.sim_time
        if task.slot is None:
            self._undefer(task)
        else:
            self._release(task)
            self._pop_deferred()
        self.counters.cancelled += 1

    def abort_all(self) -> list[Task]:
        """End every task (after an internal error); returns them so their clients can be woken."""
        ended = [*self.running, *itertools.chain.from_iterable(self.deferred)]
        for task in ended:
            task.finished = True
            task.finish_reason = "stop"
            if task.slot is not None and task.slot.task is task:
                task.slot.task = None
        self.running.clear()
        self.deferred.clear()
        return ended

    def has_work(self) -> bool:
        return bool(self.running)

    # --- memory -------------------------------------------------------------------------------------------
    def pinned_gb(self) -> float:
        if self.machine.kv_at_start:
            return self.machine.fixed_gb(self.external_gb) + self.kv_cache_gb
        held = sum(self.machine.sequence_gb(t.n_past + t.n_decoded) for t in self.running)
        return self.machine.fixed_gb(self.external_gb) + held

    def _observe_memory(self) -> None:
        pinned = self.pinned_gb()
        c = self.counters
        c.peak_pinned_gb = max(c.peak_pinned_gb, pinned)
        state = self.machine.state(pinned).value
        if STATE_ORDER[state] > STATE_ORDER[c.worst_state]:
            c.worst_state = state

    def reset_stats(self) -> None:
        c = self.counters
        c.completed = c.cancelled = 0
        c.max_concurrent = len(self.running)
        c.peak_pinned_gb = 0.0
        c.worst_state = MemoryState.HEALTHY.value
        self._observe_memory()

    # --- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[Task]:
        """One decode call over every running sequence; returns the tasks that produced output or ended."""
        decode = [t for t in self.running if not t.prefilling]
        budget = self.machine.n_batch - len(decode)
        prefill: list[tuple[Task, int]] = []
        for task in self.running:
            if budget <= 0:
                break
            if task.prefilling and task.parent is None:
                take = min(budget, task.n_prompt - task.n_past)
                prefill.append((task, take))
                budget -= take
        n_prefill = sum(take for _, take in prefill)
        dt = self.machine.step_seconds(len(decode), n_prefill, self.pinned_gb())
        self.sim_time += dt
        c = self.counters
        c.busy_s += dt
        c.n_decode_total += 1
        c.n_busy_slots_total += len(self.running)
        progressed: list[Task] = []
        for task in decode:
            self._emit(task)
            progressed.append(task)
        for task, take in prefill:
            task.n_past += take
            if not task.prefilling:
                task.t_prompt_done = self.sim_time
                processed = task.n_prompt - task.n_cache
                c.prompt_tokens_total += processed
                c.prompt_tokens_cached_total += task.n_cache
                c.prompt_seconds_total += task.prompt_ms / 1000.0
                c.bucket_prompt_tokens += processed
                c.bucket_prompt_seconds += task.prompt_ms / 1000.0
                for ready in [task, *self._start_children(task)]:
                    if ready.pooled:
                        self._finish(ready, "stop")
                    else:
                        self._emit(ready)
                    progressed.append(ready)
        self._observe_memory()
        for task in progressed:
            if task.finished:  # a slot released: llama-server offers the deferred queue one task per release
                self._pop_deferred()
        return progressed

    def _start_children(self, parent: Task) -> list[Task]:
        # llama-server's copy_state_to, right after the decode that ends the parent's prompt: each child takes
        # the parent's KV and prompt stats (so its timings repeat the parent's, and /metrics counts the prompt
        # once) and samples its first token from the same logits, in the same step
        children = [t for t in self.running if t.parent is parent]
        for child in children:
            child.n_cache, child.n_past = parent.n_cache, parent.n_past
            child.t_start, child.t_prompt_done = parent.t_start, parent.t_prompt_done
        return children

    def _emit(self, task: Task) -> None:
        task.n_decoded += 1
        self.counters.tokens_generated += 1
        total = task.n_prompt + task.n_decoded
        self.counters.n_tokens_max = max(self.counters.n_tokens_max, total)
        if task.n_decoded >= task.n_predict:
            self._finish(task, task.finish_on_limit)
        elif task.slot is not None and total >= task.slot.n_ctx:
            self._finish(task, "length")

    def _finish(self, task: Task, reason: str) -> None:
        task.finished = True
        task.finish_reason = reason
        task.t_end = self.sim_time
        c = self.counters
        c.completed += 1
        c.tokens_predicted_total += task.n_decoded
        c.tokens_predicted_seconds_total += task.predicted_ms / 1000.0
        c.bucket_predicted_tokens += task.n_decoded
        c.bucket_predicted_seconds += task.predicted_ms / 1000.0
        self._release(task)

    def _release(self, task: Task) -> None:
        slot = task.slot
        if slot is None:
            return
        if task.prefilling:
            self._orphan(task)
        kept = task.prompt[: task.n_past * tokens.CHARS_PER_TOKEN]
        # llama-server clears a child's slot when it ends: the parent's cache is enough
        slot.cached = "" if task.parent else kept + tokens.filler(task.n_decoded)
        slot.task = None
        slot.last_used = self.sim_time
        self.running.remove(task)

    def _launch(self, group: list[Task]) -> None:
        # llama-server's process_single_task: a task and its children start at once if enough slots are idle
        # for all of them, whatever waits in the deferred queue (a single request overtakes a group left
        # waiting there); else they go to the back of the queue, together
        idle = [s for s in self.slots if s.task is None]
        if len(idle) < len(group):
            self.deferred.append(group)
            return
        parent, *children = group
        first, shared = self._pick_slot(idle, parent)
        idle.remove(first)
        if shared and not parent.pooled:  # llama-server reuses no cache for a stateless task
            parent.n_cache = parent.n_past = min(shared, parent.n_prompt - 1)
        # the children take the lowest-numbered idle slots (get_free_slots) and wait there for the parent
        for child in children:
            child.parent = parent
        for task, slot in [(parent, first), *zip(children, idle, strict=False)]:
            task.slot = slot
            task.t_start = self.sim_time
            slot.task = task
            self.running.append(task)
        self.counters.max_concurrent = max(self.counters.max_concurrent, len(self.running))

    def _pop_deferred(self) -> None:
        # llama-server's server_queue::pop_deferred_task, called as a slot is released: only the deferred
        # queue's front task is offered again; one still short of slots goes to the back, so a single request
        # behind it can wait beside an idle slot until the next release
        if self.deferred:
            self._launch(self.deferred.popleft())

    def _orphan(self, parent: Task) -> None:
        # a parent cancelled before its prompt is done: its first child prefills the prompt for the others
        # (llama-server cancels a request's generations together, so it never leaves children waiting)
        children = [t for t in self.running if t.parent is parent]
        for child in children:
            child.parent = children[0] if child is not children[0] else None

    def _undefer(self, task: Task) -> None:
        # a request's generations are cancelled one by one: their group leaves the queue with the last
        for i, group in enumerate(self.deferred):
            if task in group:
                group.remove(task)
                if not group:
                    del self.deferred[i]
                return

    @staticmethod
    def _pick_slot(idle: list[Slot], task: Task) -> tuple[Slot, int]:
        """The idle slot sharing the longest prefix (if similar enough), else the least recently used."""
        best, best_shared = None, 0
        for slot in idle:
            shared = tokens.common_prefix_tokens(slot.cached, task.prompt) if slot.cached else 0
            if shared > best_shared:
                best, best_shared = slot, shared
        if best is not None and best_shared >= SLOT_PROMPT_SIMILARITY * task.n_prompt:
            return best, best_shared
        lru = min(idle, key=lambda s: s.last_used)
        return lru, tokens.common_prefix_tokens(lru.cached, task.prompt) if lru.cached else 0


class Runner:
    """Runs an Engine in one asyncio task, pacing simulated time at ``speed`` x the wall clock.

    It also never runs more than ``MAX_BACKLOG`` tokens ahead of a streaming handler that simply has not
    been scheduled yet: if Python cannot deliver tokens as fast as ``speed`` asks, simulated time slows down
    instead of the engine finishing work that clients only see later (which would distort every
    measurement). A handler blocked writing to a client that does not read (flow control), or one that has
    taken nothing for ``STALL_S``, is not waited for: a real server does not wait for slow readers.
    """

    MAX_BACKLOG = 8
    STALL_S = 0.5

    def __init__(self, engine: Engine, speed: float = 1.0) -> None:
        self.engine = engine
        self.speed = speed
        self._work = asyncio.Event()
        self._sent = asyncio.Event()
        self._anchor_wall = time.monotonic()
        self._anchor_sim = 0.0

    def sim_now(self) -> float:
        """Simulated time now: the engine's clock while busy, the wall clock x speed while idle."""
        if self.engine.has_work():
            return self.engine.sim_time
        derived = self._anchor_sim + (time.monotonic() - self._anchor_wall) * self.speed
        return max(self.engine.sim_time, derived)

    def submit(self, *tasks: Task) -> None:
        for task in tasks:
            task.wake = asyncio.Event()
        if not self.engine.has_work():
            self.engine.sim_time = self.sim_now()
            self._anchor_wall, self._anchor_sim = time.monotonic(), self.engine.sim_time
        self.engine.submit(*tasks)
        self._work.set()

    def cancel(self, task: Task) -> None:
        self.engine.cancel(task)

    def sent(self, task: Task, n_sent: int) -> None:
        """A streaming consumer wrote tokens up to ``n_sent``."""
        task.streaming = True
        task.n_sent = n_sent
        task.sent_at = time.monotonic()
        self._sent.set()

    def _behind(self) -> bool:
        now = time.monotonic()
        return any(
            t.streaming
            and not t.writing
            and t.n_decoded - t.n_sent > self.MAX_BACKLOG
            and now - t.sent_at < self.STALL_S
            for t in self.engine.running
        )

    async def _wait_for_readers(self) -> None:
        while self._behind():
            self._sent.clear()
            await wait_event(self._sent, self.STALL_S)

    async def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work():
                # idle from the engine's clock on: no jump if the busy period ended behind the wall clock
                self._anchor_wall, self._anchor_sim = time.monotonic(), engine.sim_time
                self._work.clear()
                await self._work.wait()
                continue
            if self._behind():
                await self._wait_for_readers()
            try:
                progressed = engine.step()
            except Exception:  # a bug must not leave every client hanging on a dead engine
                log.exception("simulator step failed; ending all tasks")
                progressed = engine.abort_all()
            target = self._anchor_wall + (engine.sim_time - self._anchor_sim) / self.speed
            delay = target - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                if delay < -MAX_LAG_S:
                    self._anchor_wall, self._anchor_sim = time.monotonic(), engine.sim_time
                await asyncio.sleep(0)
            for task in progressed:
                if task.wake is not None:
                    task.wake.set()


@dataclass
class VirtualResult:
    concurrency: int
    throughput_tok_s: float
    p50_latency_s: float
    ttft_p50_s: float
    peak_pinned_gb: float
    state: str
    sim_seconds: float


def closed_loop(
    machine: Machine,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    requests_per_client: int = 2,
    n_ctx_slot: int | None = None,
    external_gb: float = 0.0,
) -> VirtualResult:
    """Drive ``concurrency`` closed-loop clients through an Engine with no I/O (tests, fitting, docs)."""
    n_ctx = n_ctx_slot or (prompt_tokens + max_tokens + 16)
    engine = Engine(machine, concurrency, n_ctx)
    engine.external_gb = external_gb
    serial = itertools.count()

    def new_task() -> Task:
        text = tokens.make_prompt(prompt_tokens, salt=str(next(serial)))
        task = Task(prompt=text, n_prompt=tokens.count(text), n_predict=max_tokens)
        engine.submit(task)
        return task

    remaining = [requests_per_client - 1] * concurrency
    live = {new_task(): i for i in range(concurrency)}
    done: list[Task] = []
    generated = 0
    while live:
        for task in engine.step():
            generated += 1
            if task.finished:
                client = live.pop(task)
                done.append(task)
                if remaining[client] > 0:
                    remaining[client] -= 1
                    live[new_task()] = client
    latencies = sorted(t.t_end - t.arrival for t in done)
    ttfts = sorted(t.t_prompt_done - t.arrival for t in done)
    return VirtualResult(
        concurrency=concurrency,
        throughput_tok_s=generated / engine.sim_time,
        p50_latency_s=latencies[len(latencies) // 2],
        ttft_p50_s=ttfts[len(ttfts) // 2],
        peak_pinned_gb=engine.counters.peak_pinned_gb,
        state=engine.counters.worst_state,
        sim_seconds=engine.sim_time,
    )
