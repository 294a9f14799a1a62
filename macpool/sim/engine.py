"""The simulated llama-server core: slots, the deferred queue, the KV cache and the prompt caches, batched
steps on a virtual clock.

``Engine`` is synchronous and deterministic: ``step()`` runs one llama_decode-like step over every running
sequence (one new token each, plus up to ``n_batch`` prompt tokens of prefill) and advances the simulated
clock by what the machine model says that step costs. ``Runner`` drives an Engine from one asyncio task,
pacing simulated time against the wall clock at ``speed``; if Python falls behind, simulated time simply
advances more slowly (every reported figure is in simulated time).

The slots keep their last prompt in the KV cache for the next task that shares its prefix, and llama-server's
prompt cache in host memory (``prompt_cache``) moves prompts between slots. With a unified KV cache
(``--kv-unified``) every sequence and every idle slot's prompt take cells from one pool: idle slots are
cleared to make room, and a step that still finds too few cells fails every running task, as llama-server's
``update_slots`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from macpool.loops import wait_event
from macpool.sim import tokens
from macpool.sim.machine import STATE_ORDER, Machine, MemoryState
from macpool.sim.prompt_cache import PromptCache

log = logging.getLogger("macpool.sim")

# falling further behind the wall clock than this re-anchors the clock instead of rushing to catch up
MAX_LAG_S = 0.1
# a slot chosen for its prompt keeps it unless the new prompt shares less than this share of it: then the
# prompt is saved to the prompt cache first (get_available_slot's f_keep)
MIN_KEEP = 0.5
# llama-server's error for every running task when the unified KV cache has no cells left for a step
CONTEXT_EXCEEDED = "Context size has been exceeded."


@dataclass(frozen=True)
class ServerOptions:
    """llama-server's flags for its slots and caches; the defaults are llama-server's."""

    kv_unified: bool = False  # --kv-unified: every slot takes cells from one pool of n_cells
    n_cells: int = 0  # the KV cache's cells (the whole context, -c); 0: slots x context per slot
    cache_ram_mib: int = 8192  # --cache-ram: the prompt cache in host memory (-1: no limit, 0: none)
    cache_idle_slots: bool = True  # --cache-idle-slots: save idle slots as a task starts (needs the cache)
    slot_prompt_similarity: float = 0.1  # --slot-prompt-similarity (0: never choose a slot by its prompt)


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
    error: str = ""  # llama-server's error for a task it failed (a server_error)
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
    id_slot: int = -1  # the slot the request names (its body's ``id_slot``; -1: any)

    @property
    def prefilling(self) -> bool:
        return self.n_past < self.n_prompt

    @property
    def answered(self) -> bool:
        """Finished with an answer (not an error)."""
        return self.finished and not self.error

    @property
    def held(self) -> int:
        """Tokens in its KV cache: the prompt so far and what it generated."""
        return self.n_past + self.n_decoded

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
    last_used: float = -1.0  # never used: llama-server's -1


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
    failed: int = 0
    prompt_cache_restores: int = 0
    max_concurrent: int = 0
    peak_pinned_gb: float = 0.0
    worst_state: str = MemoryState.HEALTHY.value


class Engine:
    """Slots, the deferred queue and the batched step, with no I/O."""

    def __init__(
        self, machine: Machine, n_slots: int, n_ctx_slot: int, options: ServerOptions = ServerOptions()
    ) -> None:
        self.machine = machine
        self.options = options
        self.slots = [Slot(i, n_ctx_slot) for i in range(n_slots)]
        # llama-server's deferred tasks: each one prompt's generations (a task and its n_cmpl - 1 children)
        self.deferred: deque[list[Task]] = deque()
        self.running: list[Task] = []
        self.sim_time = 0.0
        self.external_gb = 0.0
        self.n_cells = options.n_cells or n_slots * n_ctx_slot
        self.kv_cache_gb = machine.kv_cache_gb(self.n_cells)
        self.prompt_cache = (
            PromptCache(options.cache_ram_mib, self.n_cells, machine.kv_mb_per_token)
            if options.cache_ram_mib else None
        )
        self.counters = Counters()
        self._ids = itertools.count()
        self._stall_s = 0.0  # prompt-cache copies since the last step: the next step waits for them

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
            self._pop_deferred(task.slot)
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

    def cells_used(self) -> int:
        """KV cells taken: each running sequence's tokens, and each idle slot's prompt. With a unified cache
        a child shares its parent's prompt cells and takes only those it generates."""
        unified = self.options.kv_unified
        running = sum(t.n_decoded if unified and t.parent is not None else t.held for t in self.running)
        return running + sum(tokens.count(s.cached) for s in self.slots if s.task is None)

    def _observe_memory(self) -> None:
        pinned = self.pinned_gb()
        c = self.counters
        c.peak_pinned_gb = max(c.peak_pinned_gb, pinned)
        state = self.machine.state(pinned).value
        if STATE_ORDER[state] > STATE_ORDER[c.worst_state]:
            c.worst_state = state

    def reset_stats(self) -> None:
        c = self.counters
        c.completed = c.cancelled = c.failed = c.prompt_cache_restores = 0
        c.max_concurrent = len(self.running)
        c.peak_pinned_gb = 0.0
        c.worst_state = MemoryState.HEALTHY.value
        self._observe_memory()

    # --- the step -----------------------------------------------------------------------------------------
    def step(self) -> list[Task]:
        """One decode call over every running sequence; returns the tasks that produced output or ended."""
        # llama-server builds the batch slot by slot: every generating slot's next token, then the prompts
        # of the slots still processing theirs, until n_batch tokens
        in_slots = sorted(self.running, key=lambda t: t.slot.id if t.slot else -1)
        decode = [t for t in in_slots if not t.prefilling]
        budget = self.machine.n_batch - len(decode)
        prefill: list[tuple[Task, int]] = []
        for task in in_slots:
            if budget <= 0:
                break
            if task.prefilling and task.parent is None:
                take = min(budget, task.n_prompt - task.n_past)
                prefill.append((task, take))
                budget -= take
        if self.options.kv_unified:
            needed = len(decode) + sum(take for _, take in prefill)
            while needed > self.n_cells - self.cells_used() and self._clear_idle_slot():
                pass
            if needed > self.n_cells - self.cells_used():
                return self._out_of_cells(decode, prefill)
        self._advance(decode, prefill)
        progressed: list[Task] = []
        for task in decode:
            self._emit(task)
            progressed.append(task)
        c = self.counters
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
                self._pop_deferred(task.slot)
        return progressed

    def _advance(self, decode: list[Task], prefill: list[tuple[Task, int]]) -> None:
        """The clock through one decode of ``decode``'s tokens and ``prefill``'s prompt chunks, after any
        prompt-cache copies made since the last step."""
        chunks = [(task.n_past, take) for task, take in prefill]
        dt = self._stall_s + self.machine.step_seconds([t.held for t in decode], chunks, self.pinned_gb())
        self._stall_s = 0.0
        self.sim_time += dt
        c = self.counters
        c.busy_s += dt
        c.n_decode_total += 1
        c.n_busy_slots_total += len(self.running)

    def _clear_idle_slot(self) -> bool:
        # llama-server's try_clear_idle_slots: the first idle slot still holding a prompt gives its cells back
        for slot in self.slots:
            if slot.task is None and slot.cached:
                slot.cached = ""
                return True
        return False

    def _out_of_cells(self, decode: list[Task], prefill: list[tuple[Task, int]]) -> list[Task]:
        # llama_decode finds no cells for the batch: llama-server retries with halves of it until a single
        # token does not fit, then fails every running task and clears its slot (update_slots, decode)
        room = max(0, self.n_cells - self.cells_used())
        fits, fit_prefill = decode[:room], []
        room -= len(fits)
        for task, take in prefill:
            if room > 0:
                fit_prefill.append((task, min(take, room)))
                room -= take
        self._advance(fits, fit_prefill)
        failed = list(self.running)
        for task in failed:
            self._fail(task, CONTEXT_EXCEEDED)
        self._observe_memory()
        for task in failed:
            self._pop_deferred(task.slot)
        return failed

    def _fail(self, task: Task, message: str) -> None:
        task.finished = True
        task.error = message
        task.finish_reason = "error"
        task.t_end = self.sim_time
        c = self.counters
        c.failed += 1
        c.tokens_predicted_total += task.n_decoded
        c.tokens_predicted_seconds_total += task.predicted_ms / 1000.0
        slot = task.slot
        self._release(task)
        if slot is not None:
            slot.cached = ""

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
        if all(s.task is not None for s in self.slots):
            self.deferred.append(group)
            return
        parent, *children = group
        first = self._available_slot(parent)
        if first.task is not None:  # the slot it names is busy: it waits for that one
            self.deferred.append(group)
            return
        # the children take the lowest-numbered other idle slots (get_free_slots) and wait there
        others = [s for s in self.slots if s.task is None and s is not first][: len(children)]
        if len(others) < len(children):
            self.deferred.append(group)
            return
        shared = tokens.common_prefix_tokens(first.cached, parent.prompt) if first.cached else 0
        if shared and not parent.pooled:  # llama-server reuses no cache for a stateless task
            parent.n_cache = parent.n_past = min(shared, parent.n_prompt - 1)
        for child in children:
            child.parent = parent
        for task, slot in [(parent, first), *zip(children, others, strict=True)]:
            task.slot = slot
            task.t_start = self.sim_time
            slot.task = task
            self.running.append(task)
        self.counters.max_concurrent = max(self.counters.max_concurrent, len(self.running))
        if self.options.cache_idle_slots and self.prompt_cache is not None:
            self._cache_idle_slots()

    def _available_slot(self, task: Task) -> Slot:
        """llama-server's get_available_slot: the idle slot whose prompt shares the largest share of the new
        one (more than ``slot_prompt_similarity``), else the least recently used; a slot chosen by use, or
        whose prompt the new one keeps less than half of, first saves its prompt to the prompt cache and
        takes the best one saved there for the new prompt."""
        chosen, update, kept = None, False, 1.0
        if task.id_slot != -1:
            return self._named_slot(task)
        if self.options.slot_prompt_similarity:
            best = 0.0
            for slot in self.slots:
                if slot.task is not None or not slot.cached:
                    continue
                shared = tokens.common_prefix_tokens(slot.cached, task.prompt)
                similarity = shared / max(1, task.n_prompt)
                if similarity > best and similarity > self.options.slot_prompt_similarity:
                    chosen, best, kept = slot, similarity, shared / tokens.count(slot.cached)
            update = chosen is not None and kept < MIN_KEEP
        if chosen is None:
            for slot in self.slots:  # the last of the least recently used, as llama-server's "<="
                if slot.task is None and (chosen is None or slot.last_used <= chosen.last_used):
                    chosen = slot
            update = True
        assert chosen is not None  # the caller checked that a slot is idle
        if update and self.prompt_cache is not None and not task.pooled:  # only completions use the cache
            self._save(chosen)
            self._restore(chosen, task.prompt)
            self.prompt_cache.update()
        return chosen

    def _named_slot(self, task: Task) -> Slot:
        """get_available_slot for a task that names its slot (``id_slot``, wrapped around the slots): that
        slot, idle or not (the caller defers it while busy). Idle, and holding a prompt that the new one
        shares too little of (not over ``slot_prompt_similarity``, or keeping less than half of it), the slot
        saves its prompt to the prompt cache and takes the best one saved there; an empty slot takes none (in
        llama-server its share kept is 0/0, which is not under a half). llama-server also saves and loads
        the cache of a busy named slot, over its running request: the agent never names a busy slot, and
        this does not model it."""
        chosen = self.slots[task.id_slot % len(self.slots)]
        if chosen.task is not None or not chosen.cached or not self.options.slot_prompt_similarity:
            return chosen
        shared = tokens.common_prefix_tokens(chosen.cached, task.prompt)
        # (its similarity loop looks for the slot by the id as given, not wrapped)
        threshold = self.options.slot_prompt_similarity
        similar = task.id_slot == chosen.id and shared / max(1, task.n_prompt) > threshold
        kept = shared / tokens.count(chosen.cached) if similar else 0.0
        if kept < MIN_KEEP and self.prompt_cache is not None and not task.pooled:
            self._save(chosen)
            self._restore(chosen, task.prompt)
            self.prompt_cache.update()
        return chosen

    def _save(self, slot: Slot) -> bool:
        assert self.prompt_cache is not None
        if not self.prompt_cache.save(slot.cached):
            return False
        self._stall_s += self.machine.state_copy_seconds(tokens.count(slot.cached))
        return True

    def _restore(self, slot: Slot, prompt: str) -> None:
        assert self.prompt_cache is not None
        saved = self.prompt_cache.best(slot.cached, prompt)
        if saved is None:
            return
        if self.options.kv_unified:  # the restored prompt needs cells of the one pool
            free = self.n_cells - self.cells_used() + tokens.count(slot.cached)
            if saved.n_tokens > free:  # llama_state_seq_set_data fails: the slot starts empty
                slot.cached = ""
                return
        self.prompt_cache.take(saved)
        slot.cached = saved.text
        self._stall_s += self.machine.state_copy_seconds(saved.n_tokens)
        self.counters.prompt_cache_restores += 1

    def _cache_idle_slots(self) -> None:
        # --cache-idle-slots: as a task starts, every idle slot's prompt is saved to the prompt cache, and
        # with a unified KV cache the slot is cleared, so its cells go back to the pool
        assert self.prompt_cache is not None
        for slot in self.slots:
            if slot.task is None:
                if self._save(slot):
                    self.prompt_cache.update()
                if self.options.kv_unified:
                    slot.cached = ""

    def _pop_deferred(self, released: Slot | None) -> None:
        # llama-server's server_queue::pop_deferred_task, called as a slot is released: the first deferred
        # task that names the released slot, else the queue's front task, is offered again; one still short of
        # slots goes to the back, so a single request behind it can wait beside an idle slot until the next
        # release
        if not self.deferred:
            return
        for i, group in enumerate(self.deferred):
            if released is not None and group[0].id_slot == released.id:
                del self.deferred[i]
                self._launch(group)
                return
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
