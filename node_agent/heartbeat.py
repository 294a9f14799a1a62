"""Each interval: look at llama-server and memory, decide capacity, write the node document to Redis."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from macpool import __version__
from macpool.contract import (
    LoadCost,
    MemoryFigures,
    ModelState,
    NodeDoc,
    NodeState,
    heartbeat_ttl_ms,
    now_ms,
)
from macpool.gguf_info import ModelShape
from macpool.loops import every
from macpool.store import Keys, Store
from macpool.store.connect import AnyRedis
from macpool.wol import normalize_mac

from . import capacity, kv
from .memory import GB, MemoryProbe, MemorySample, ProbeError, UpstreamUnreachable
from .runtime import PrefillReading, Runtime, model_query
from .standby import REASONS, standby_models

log = logging.getLogger("macpool.agent")

UpstreamCondition = Literal["healthy", "loading", "unreachable"]
PREFILL_MIN_TOKENS = 512  # prompt tokens processed between two readings of the prefill speed
# the model's phase in a node state (any other: loaded)
MODEL_PHASE: dict[str, Literal["loaded", "loading", "loadable"]] = {
    "standby": "loadable", "asleep": "loadable", "waking": "loadable",
    "starting": "loading", "loading": "loading", "unhealthy": "loading",
}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value} for the unlabelled ``llamacpp:*`` samples (prometheus_client's
    parser: a counter's sample is named ``..._total``); what a malformed page held before its fault."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("llamacpp:") and not sample.labels:
                    values[sample.name] = sample.value
    except ValueError:
        pass  # the samples read so far are llama-server's; the rest of the page is not
    return values


@dataclass
class UpstreamView:
    """What llama-server said on its last poll."""

    healthy: bool = False
    reachable: bool = False
    problem: str = ""  # why it is not healthy, for the log: "not answering /health (ConnectError)"
    total_slots: int = 0
    ctx_per_slot: int = 0
    build: str = ""
    models: list[str] = field(default_factory=list)
    tokens_total: float | None = None
    tokens_at: float = 0.0
    tokens_per_s: float = 0.0
    n_ctx_train: int = 0  # the model's training context (/v1/models), 0 until known
    kv_cells_used: int = 0  # KV cells the slots hold now (/slots)
    # prompt tokens processed and seconds spent on them so far (/metrics), and where the last prefill
    # reading of them was taken
    prompt_tokens: float | None = None
    prompt_seconds: float | None = None
    prompt_tokens_cached: float = 0.0  # prompt tokens read from a cache instead (0 where not reported)
    # (prompt tokens, seconds, cached tokens, prompts the agent saw begin answering, its seconds with a
    # prompt in llama-server, its prompts' seconds added up) at the last reading
    prefill_mark: tuple[float, float, float, int, float, float] | None = None
    starts: int = 0  # times it turned healthy: each may be another llama-server, with other arguments

    @property
    def condition(self) -> UpstreamCondition:
        return "healthy" if self.healthy else "loading" if self.reachable else "unreachable"


async def poll_upstream(client: httpx.AsyncClient, base: str, view: UpstreamView, model: str | None = None
                        ) -> None:
    """Refresh ``view`` in place; a failure marks the upstream unhealthy and keeps the last figures.

    With ``model``, the upstream is llama-server's router mode and the view is of that one model: healthy
    when ``/models`` calls it loaded, its figures from ``?model=`` (relayed to the model's own process).
    """
    try:
        if model is None:
            health = await client.get(base + "/health", timeout=2.0)
            healthy, problem = health.status_code == 200, f"answering /health with HTTP {health.status_code}"
        else:
            healthy, problem = await _model_loaded(client, base, model)
    except httpx.HTTPError as exc:
        view.healthy = view.reachable = False
        view.problem = f"not answering /health ({type(exc).__name__})"
        return
    view.reachable = True
    if healthy and not view.healthy:
        view.starts += 1
    view.healthy = healthy
    if not view.healthy:
        view.problem = problem
        return
    view.problem = ""
    query = model_query(model)
    polls = [client.get(base + path + query, timeout=2.0) for path in ("/props", "/metrics", "/slots")]
    if model is None:  # (a model of several is the one it is: the router-mode server lists them all)
        polls.append(client.get(base + "/v1/models", timeout=2.0))
    props, metrics, slots, *listed = await asyncio.gather(*polls, return_exceptions=True)
    models = listed[0] if listed else None
    if isinstance(props, httpx.Response) and props.status_code == 200:
        data = props.json()
        view.total_slots = int(data.get("total_slots", 0))
        view.ctx_per_slot = int(data.get("default_generation_settings", {}).get("n_ctx", 0))
        view.build = str(data.get("build_info", ""))
    if isinstance(models, httpx.Response) and models.status_code == 200:
        names: list[str] = []
        entries = models.json().get("data", [])
        for entry in entries:
            for name in [entry.get("id"), *entry.get("aliases", [])]:
                if isinstance(name, str) and name and name not in names:
                    names.append(name)
        view.models = names
        view.n_ctx_train = training_context(entries)
    slot_list: object = None
    if isinstance(slots, httpx.Response) and slots.status_code == 200:
        with contextlib.suppress(ValueError):
            slot_list = slots.json()
        view.kv_cells_used = cells_held(slot_list)
    if isinstance(metrics, httpx.Response) and metrics.status_code == 200:
        values = parse_metrics(metrics.text)
        total = values.get("llamacpp:tokens_predicted_total")
        if total is not None and slot_list is not None:
            total += decoded_so_far(slot_list)
        _update_rate(view, total)
        view.prompt_tokens = values.get("llamacpp:prompt_tokens_total")
        view.prompt_seconds = values.get("llamacpp:prompt_seconds_total")
        view.prompt_tokens_cached = values.get("llamacpp:prompt_tokens_cached_total") or 0.0


async def _model_loaded(client: httpx.AsyncClient, base: str, model: str) -> tuple[bool, str]:
    """Whether llama-server's router mode has ``model`` loaded, and if not what it says of it."""
    response = await client.get(base + "/models", timeout=2.0)
    if response.status_code != 200:
        return False, f"answering /models with HTTP {response.status_code}"
    status = model_status(response.json(), model)
    return status == "loaded", f"model {model!r} is {status or 'not listed'}"


def model_status(listing: object, model: str) -> str | None:
    """``model``'s status in a router-mode ``GET /models`` answer (loaded, loading, unloaded), or None."""
    entries = listing.get("data") if isinstance(listing, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and entry.get("id") == model:
            status = entry.get("status")
            value = status.get("value") if isinstance(status, dict) else None
            return value if isinstance(value, str) else None
    return None


def decoded_so_far(slots: object) -> int:
    """Tokens the requests still running have generated (llama-server's ``/slots``): its
    ``tokens_predicted_total`` counts a request's tokens only when it ends, so without these a Mac busy
    with long generations would read 0 tokens/s until the first one ended."""
    total = 0
    for slot in slots if isinstance(slots, list) else ():
        if isinstance(slot, dict) and slot.get("is_processing"):
            for progress in slot.get("next_token") or ():
                decoded = progress.get("n_decoded") if isinstance(progress, dict) else None
                if type(decoded) is int:
                    total += decoded
    return total


def cells_held(slots: object) -> int:
    """KV cells llama-server's slots hold now (``/slots``): each slot's tokens, prompt and generated, idle
    slots' cached prompts included (they hold their cells until a new task clears them)."""
    held = 0
    for slot in slots if isinstance(slots, list) else ():
        tokens = slot.get("n_prompt_tokens") if isinstance(slot, dict) else None
        if type(tokens) is int and tokens > 0:
            held += tokens
    return held


def training_context(models: object) -> int:
    """The model's training context from ``/v1/models`` (llama-server's ``meta.n_ctx_train``; 0: none)."""
    for entry in models if isinstance(models, list) else ():
        meta = entry.get("meta") if isinstance(entry, dict) else None
        value = meta.get("n_ctx_train") if isinstance(meta, dict) else None
        if type(value) is int and value > 0:
            return value
    return 0


def prefill_reading(view: UpstreamView, prompts: int, overlap: tuple[float, float]) -> PrefillReading | None:
    """How far the prompt counters moved since the last reading (``Runtime.note_prefill`` makes the speed and
    the depth of them): once at least ``PREFILL_MIN_TOKENS`` have been processed (fewer say more of a step's
    fixed cost than of the prompt's). ``prompts``: the answers the agent has seen begin so far, each a prompt
    processed; a prompt's tokens sit after the part of it its cache held. ``overlap``:
    ``Runtime.prompt_overlap``, with which llama-server's seconds (each slot's added) are brought to the
    Mac's where prompts were processed side by side. Prompts processed while the agent sent none are someone
    else's (llama-server used directly): they are not read, nor is a reading taken before an answer the agent
    sent began."""
    tokens, seconds, cached = view.prompt_tokens, view.prompt_seconds, view.prompt_tokens_cached
    if tokens is None or seconds is None:
        return None
    busy, summed = overlap
    mark = view.prefill_mark
    if mark is None or tokens < mark[0] or seconds < mark[1] or cached < mark[2]:  # first, or restarted
        view.prefill_mark = (tokens, seconds, cached, prompts, busy, summed)
        return None
    if summed <= mark[5]:  # prompts it did not send (llama-server used directly): not this pool's measure
        view.prefill_mark = (tokens, seconds, cached, prompts, busy, summed)
        return None
    if tokens - mark[0] < PREFILL_MIN_TOKENS or seconds <= mark[1] or prompts == mark[3]:
        return None
    view.prefill_mark = (tokens, seconds, cached, prompts, busy, summed)
    return PrefillReading(tokens - mark[0], seconds - mark[1], busy - mark[4], summed - mark[5],
                          cached - mark[2], prompts - mark[3])


def _describe(error: Exception) -> str:
    """A probe's own errors say what failed; another (a timeout, an OS error) is named by its type."""
    if isinstance(error, ProbeError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _update_rate(view: UpstreamView, total: float | None) -> None:
    """Tokens/s from the counter's delta over wall time, smoothed (restarts reset the counter)."""
    now = time.monotonic()
    if total is None:
        return
    if view.tokens_total is not None and total >= view.tokens_total and now > view.tokens_at:
        rate = (total - view.tokens_total) / (now - view.tokens_at)
        view.tokens_per_s = 0.7 * view.tokens_per_s + 0.3 * rate
    view.tokens_total, view.tokens_at = total, now


def _rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class Heartbeat:
    """One agent's heartbeat: observation, the capacity decision, and the Redis write."""

    runtime: Runtime
    redis: AnyRedis
    probe: MemoryProbe
    model_shape: ModelShape | None
    kv_bytes_per_token: int | None
    # called after ``shrink_after_beats`` heartbeats in a row under memory pressure (then counted afresh)
    on_persistent_pressure: Callable[[int], None] | None = None
    pressure_beats: int = 0
    started_at_ms: int = field(default_factory=now_ms)
    instance: str = field(default_factory=lambda: secrets.token_hex(8))  # this process, in the node record
    superseded_by: str | None = None  # the URL of the agent started later that holds our node id
    upstream: UpstreamView = field(default_factory=UpstreamView)
    pressure: capacity.PressureGuard = field(default_factory=capacity.PressureGuard)
    was_ready: bool = False
    # the upstream's condition as last logged; None while the supervisor is the one telling (supervise mode)
    upstream_seen: UpstreamCondition | None = None
    probe_failing: bool = False
    cap_warned_slots: int | None = None  # the slot count --cap was last found above
    redis_ok: bool = True
    before_beat: Callable[[], Awaitable[None]] | None = None  # the standby follower (node_agent/standby.py)
    # one model of several on this Mac (node_agent/models.py; its name is the runtime's ``model``): the
    # memory its load is sized for (the Mac's budget holds it, so no memory term of its own); what loading
    # it would cost the Mac now
    model_memory_gb: float | None = None
    load_cost: Callable[[], LoadCost] | None = None
    # llama-server's arguments, read again for each llama-server (given its slot count): they alone say
    # whether its slots share one KV cache, of how many cells, and its -n (node_agent/kv.py)
    kv_source: Callable[[int], Awaitable[kv.Source]] | None = None
    kv_args: kv.Source | None = None
    _kv_for: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        settings = self.runtime.settings
        self.store = Store(self.redis, Keys(settings.key_prefix))
        self.ttl_ms = heartbeat_ttl_ms(settings.heartbeat_interval)
        self.pressure.recover_beats = settings.pressure_recover_beats
        self.credential = settings.credential()  # signs each document, when the pool issued one

    async def run(self) -> None:
        await every(self.runtime.settings.heartbeat_interval, self.beat, "heartbeat", log,
                    wake=self.runtime.beat_now, first_now=True)

    async def beat(self) -> None:
        """Observe, decide and publish once."""
        if self.before_beat is not None:
            await self.before_beat()
        doc = await self.observe()
        if self.credential is not None:
            doc = self.credential.sign(doc)
        await self.publish(doc)

    async def observe(self) -> NodeDoc:
        runtime = self.runtime
        sample: MemorySample | None
        poll = poll_upstream(runtime.client(), runtime.upstream_url, self.upstream, runtime.model)
        sampled = await asyncio.gather(poll, self.probe.sample(), return_exceptions=True)
        if isinstance(sampled[0], BaseException):
            raise sampled[0]
        probed = sampled[1]
        if isinstance(probed, BaseException) and not isinstance(probed, ProbeError | OSError):
            raise probed
        sample = probed if isinstance(probed, MemorySample) else None
        self._note_probe(None if isinstance(probed, MemorySample) else probed)
        await self._read_kv_args()
        doc = self._decide(sample)
        runtime.doc = doc
        return doc

    async def _read_kv_args(self) -> None:
        """llama-server's arguments, once for each llama-server: read when one turns healthy or its
        slots change; logged with the cache they give."""
        view = self.upstream
        key = (view.starts, view.total_slots, view.ctx_per_slot)
        if self.kv_source is None or not view.healthy or not view.total_slots or key == self._kv_for:
            return
        found = self.kv_args = await self.kv_source(view.total_slots)
        self._kv_for = key
        cache = kv.layout(found.args, view.total_slots, view.ctx_per_slot, view.n_ctx_train)
        self.runtime.details["kv"] = {**found.as_dict(), "cache": cache.describe(view.total_slots)}
        whose = "llama-server" if self.runtime.model is None else f"model {self.runtime.model}"
        said = f"{whose}'s KV cache: {cache.describe(view.total_slots)}"
        if found.known:
            log.info("%s (from %s)", said, found.said)
        else:
            log.warning("%s: taking %s; give its arguments after -- if it was started otherwise", said,
                        found.said)

    def _note_probe(self, error: ProbeError | OSError | None) -> None:
        """Warn once when the memory probe starts failing, and say when it answers again.

        Without samples there is no memory term and no pressure guard: capacity rests on the other terms,
        which an operator must hear about rather than find in the figures (all 0). /status shows the error.
        """
        name = self.probe.name
        if error is None:
            if self.probe_failing:
                log.info("memory probe %s answers again", name)
            self.probe_failing = False
            self.runtime.details["memory_probe_error"] = None
            return
        message = _describe(error)
        self.runtime.details["memory_probe_error"] = message
        if isinstance(error, UpstreamUnreachable):
            return  # the simulator's figures come from llama-server, whose own line says it is down
        if not self.probe_failing:
            log.warning(
                "memory probe %s failed: %s; no memory limit and no pressure guard until it answers",
                name,
                message,
            )
        self.probe_failing = True

    def _decide(self, sample: MemorySample | None) -> NodeDoc:
        runtime, settings, view = self.runtime, self.runtime.settings, self.upstream
        cache = self._kv_cache()
        per_request = self._per_request_gb(sample, self._slot_share(cache))
        weights = self._weights_gb(sample)
        memory_cap: int | None = None
        pressure_reason = ""
        figures = MemoryFigures(weights_gb=weights, per_request_gb=per_request or 0.0)
        if sample is not None:
            figures = MemoryFigures(
                total_gb=round(sample.total_gb, 3),
                wired_limit_gb=round(sample.wired_limit_gb, 3),
                weights_gb=round(weights, 3),
                pinned_gb=round(sample.pinned_gb, 3),
                per_request_gb=round(per_request or 0.0, 4),
                swap_used_gb=round(sample.swap_used_gb, 3),
                pressure=sample.pressure,
                state=capacity.memory_state(sample),
            )
            if per_request and self.runtime.model is None:
                budget = sample.wired_limit_gb - sample.external_gb
                memory_cap = capacity.memory_cap(budget, weights, settings.headroom_gb, per_request)
            if self.pressure.update(sample):
                pressure_reason = self.pressure.reason
            self._count_pressure(self.pressure.pressed)
            runtime.metrics.pinned.set(sample.pinned_gb * GB)
            runtime.metrics.wired_limit.set(sample.wired_limit_gb * GB)
        self._log_upstream_change()
        reading = prefill_reading(view, runtime.prompts_begun, runtime.prompt_overlap())
        if reading is not None:
            runtime.note_prefill(reading)
        slots = view.total_slots or None
        self._warn_cap_over_slots(slots)
        decision = capacity.decide(
            settings.cap, memory_cap, settings.calibrated_cap, runtime.in_flight, pressure_reason, slots
        )
        state, reason = self._state(decision)
        state = runtime.capacity_decided(state, decision.capacity, view.total_slots)
        reason = REASONS.get(state, reason)
        runtime.details["memory_probe"] = self.probe.name
        runtime.details["upstream"] = {"healthy": view.healthy, "reachable": view.reachable}
        if self.runtime.model is not None:
            models = [self.runtime.model]
        else:
            models = view.models or (standby_models(settings) if settings.follows_autoscaler else [])
        return NodeDoc(
            node_id=settings.node_id,
            url=settings.public_url,
            models=models,
            capacity=decision.capacity,
            in_flight=runtime.in_flight,
            total_slots=view.total_slots,
            state=state,
            reason=reason,
            memory=figures,
            capacity_breakdown=decision.breakdown,
            tokens_per_s=round(view.tokens_per_s, 2),
            ttft_p50_ms=runtime.ttft_p50_ms(),
            slot_tokens_per_s=_rounded(runtime.slot_tokens_per_s),
            slot_concurrency=_rounded(runtime.slot_concurrency),
            prefill_tokens_per_s=_rounded(runtime.prefill_tokens_per_s),
            prefill_depth=_rounded(runtime.prefill_depth, 0),
            ctx_per_slot=view.ctx_per_slot,
            seq_ctx=cache.seq_ctx,
            kv_unified=cache.unified,
            kv_cells=cache.cells,
            kv_cells_used=view.kv_cells_used,
            n_predict=cache.n_predict,
            sizing=runtime.sizing.reason if runtime.sizing else "",
            llama_build=view.build,
            agent_version=__version__,
            started_at_ms=self.started_at_ms,
            updated_at_ms=now_ms(),
            instance=self.instance,
            elastic=settings.follows_autoscaler,
            standby_capacity=runtime.standby_capacity if settings.follows_autoscaler else 0,
            wol_mac=normalize_mac(settings.wol_mac) if settings.wol_mac else "",
            wol_broadcast=settings.wol_broadcast if settings.wol_mac else "",
            model_states=self._model_states(models, state, decision.capacity, view, weights, per_request),
            load_cost=self.load_cost() if self.load_cost is not None else "free",
        )

    def _kv_cache(self) -> kv.KvCache:
        """The KV cache as admission counts it: the context one request may hold from /props alone, whether
        the slots share their cells and how many from llama-server's arguments (0: unknown)."""
        view, found = self.upstream, self.kv_args
        if found is None or not view.total_slots or not view.ctx_per_slot:
            return kv.KvCache(view.ctx_per_slot, False, 0, -1)
        return kv.layout(found.args, view.total_slots, view.ctx_per_slot, view.n_ctx_train)

    def _slot_share(self, cache: kv.KvCache) -> int:
        """The KV cells one slot stands for in the memory term: its own context in a split cache; its share
        of a shared one (the slots together never hold more than its cells, and any one may take them all:
        counting the whole cache per request would cap a cache sized to the memory at one request). A cache
        taken to be shared for want of llama-server's arguments may be split: its slots count in full."""
        slots, known = self.upstream.total_slots, self.kv_args is not None and self.kv_args.known
        if cache.unified and cache.cells and slots and known:
            return cache.cells // slots
        return self.upstream.ctx_per_slot

    def _model_states(self, models: list[str], state: NodeState, capacity: int, view: UpstreamView,
                      weights_gb: float, per_request_gb: float | None) -> list[ModelState]:
        """The one model this agent's llama-server serves (its first id: the others are aliases)."""
        runtime = self.runtime
        if not models:
            return []
        slots = view.total_slots or runtime.standby_capacity
        memory = None
        if self.runtime.model is not None:
            memory = _rounded(self.model_memory_gb, 4)
        elif weights_gb and per_request_gb is not None and slots:
            memory = round(weights_gb + per_request_gb * slots, 3)
        phase = MODEL_PHASE.get(state, "loaded")
        return [ModelState(
            name=models[0], state=phase, capacity=capacity if phase == "loaded" else 0,
            in_flight=runtime.in_flight, memory_gb=memory,
            load_s=round(runtime.load_s, 2) if runtime.load_s is not None else None,
        )]

    def _count_pressure(self, pressed: bool) -> None:
        # only while llama-server runs: a restart it causes must not count the beats before it again
        self.pressure_beats = self.pressure_beats + 1 if pressed and self.runtime.llama_state is None else 0
        limit = self.runtime.settings.shrink_after_beats
        act = self.on_persistent_pressure
        if self.pressure_beats >= limit and act is not None and not self.runtime.draining:
            self.pressure_beats = 0
            act(limit)

    def _warn_cap_over_slots(self, slots: int | None) -> None:
        """Say once (per slot count: a restarted llama-server may have another) that --cap is not honoured."""
        cap = self.runtime.settings.cap
        if cap is None or slots is None or cap <= slots or slots == self.cap_warned_slots:
            return
        self.cap_warned_slots = slots
        log.warning(
            "--cap %d is above llama-server's %d slots (total_slots in /props): capacity is at most %d, "
            "since requests past the slots would queue inside llama-server",
            cap,
            slots,
            slots,
        )

    def _log_upstream_change(self) -> None:
        """One line each time llama-server's health changes: the node's state alone changes silently.

        Warning when it stops being healthy, info otherwise. In supervise mode the supervisor logs its
        process's starts, exits and first health itself; this covers a llama-server that stops answering
        without exiting (hung, overloaded), once the supervisor has called it healthy.
        """
        condition = self.upstream.condition
        if self.runtime.llama_state is not None:
            self.upstream_seen = None
            return
        previous, self.upstream_seen = self.upstream_seen, condition
        if condition == previous:
            return
        if previous is None and self.runtime.settings.supervise:
            # the supervisor has just said "healthy"; a poll that went out before that is no news
            if condition != "healthy":
                self.upstream_seen = None
            return
        url = self.runtime.upstream_url
        if condition == "healthy":
            log.info("llama-server at %s is healthy", url)
        elif previous == "healthy":
            problem = self.upstream.problem
            log.warning("llama-server at %s is %s; admitting nothing until it is healthy again", url, problem)
        else:
            log.info("waiting for llama-server at %s: %s", url, self.upstream.problem)

    def _state(self, decision: capacity.Decision) -> tuple[NodeState, str]:
        if self.runtime.draining:
            return "draining", "draining: finishing in-flight requests, admitting nothing new"
        supervised = self.runtime.llama_state
        if supervised is not None:
            return supervised, f"llama-server is {supervised}"
        if not self.upstream.healthy:
            if not self.upstream.reachable:
                state: NodeState = "unhealthy" if self.was_ready else "starting"
                return state, "llama-server is not reachable"
            return "starting", "llama-server is loading"
        self.was_ready = True
        if decision.breakdown.pressure_limited:
            return "paging", decision.reason
        return "ready", decision.reason

    def _per_request_gb(self, sample: MemorySample | None, ctx_per_slot: int) -> float | None:
        settings = self.runtime.settings
        if settings.calibrated_per_request_gb:
            return settings.calibrated_per_request_gb
        if sample is not None and sample.per_request_gb:
            return sample.per_request_gb
        ctx = ctx_per_slot or settings.ctx_per_slot
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token * ctx / GB + settings.request_overhead_gb
        return None

    def _weights_gb(self, sample: MemorySample | None) -> float:
        if sample is not None and sample.weights_gb is not None:
            return sample.weights_gb
        return self.model_shape.weights_gb if self.model_shape else 0.0

    async def publish(self, doc: NodeDoc) -> None:
        """Write to Redis; while it is down, keep serving under the cap and re-register when it answers. Each
        beat is the next attempt, bounded by one interval: a Redis that does not answer never holds the beat
        longer (a lost connection is retried within the call by redis-py, with backoff and jitter)."""
        try:
            async with asyncio.timeout(self.runtime.settings.heartbeat_interval):
                holder = await self.store.heartbeat(doc, self.ttl_ms)
        except (RedisError, OSError, TimeoutError) as exc:
            self.runtime.metrics.heartbeat_failures.inc()
            if self.redis_ok:
                log.warning("redis at %s unreachable (%s: %s); serving under the local cap, retrying",
                            self.store.address, type(exc).__name__, exc)
            self.redis_ok = False
            self.runtime.details["redis_ok"] = False
            return
        if not self.redis_ok:
            log.info("redis is back; node %s re-registered", doc.node_id)
        self.redis_ok = True
        self.runtime.details["redis_ok"] = True
        self._note_holder(doc, holder)

    def _note_holder(self, doc: NodeDoc, holder: str | None) -> None:
        """Say when an agent started later takes this node id (a restart's new agent while this one drains,
        or another Mac given the same id), and when the id is this agent's again."""
        if holder == self.superseded_by:
            self.runtime.details.setdefault("superseded_by", holder)  # in /status from the first beat on
            return
        if holder is None:
            log.info("node id %s is this agent's again (%s); back in the pool", doc.node_id, doc.url)
        elif self.runtime.draining:
            log.info("node id %s is now held by an agent started later (%s); this one drains out of the "
                     "pool", doc.node_id, holder)
        else:
            log.error("node id %s is held by an agent started later (%s): routers send this agent (%s) "
                      "nothing while it does. Give each Mac its own --node-id", doc.node_id, holder, doc.url)
        self.superseded_by = holder
        self.runtime.details["superseded_by"] = holder
        self.runtime.metrics.superseded.set(0 if holder is None else 1)

    async def remove(self) -> None:
        try:
            await self.remove_node()
        except (RedisError, OSError) as exc:
            log.warning("could not remove the node key on shutdown (%s); it expires with its TTL", exc)

    async def remove_node(self) -> None:
        await self.store.deregister(self.runtime.settings.node_id, self.instance)
