"""The agent's live state, shared by the gateway (which admits) and the heartbeat (which decides capacity)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import quote

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from macpool.contract import NODE_STATES, NodeDoc, NodeState
from macpool.upstream import Upstream

from .settings import AgentSettings
from .sizing import Sizing

MIN_DECODE_EVENTS = 16  # the fewest events of an answer whose decode speed is counted
DECODE_EWMA = 0.2  # weight of the latest answer in the smoothed per-slot decode speed
PREFILL_READINGS = 8  # the latest prompt-speed readings the published speed and depth are summed over



def model_query(model: str | None) -> str:
    """The query that scopes a call to llama-server to ``model`` in its router mode ("" for the one model
    of a plain llama-server)."""
    return "" if model is None else "?model=" + quote(model, safe="")

@dataclass
class AnswerClock:
    """When a streamed answer's events came: the requests in flight at the first, and the seconds between
    tokens after it, one gap per event."""

    last_at: float = 0.0
    running: int = 0
    events: int = 0
    gaps: list[float] = field(default_factory=list)

    def tick(self, at: float, events: int, running: int) -> bool:
        """A chunk holding ``events`` events came at ``at`` with ``running`` requests in flight; True for
        the answer's first. A chunk of several events shares its gap among them; one with none (the rest
        of an event cut in two) is not a token."""
        if not events:
            return False
        first = self.events == 0
        if first:
            self.running = running
        else:
            self.gaps.extend([(at - self.last_at) / events] * events)
        self.last_at = at
        self.events += events
        return first


class AgentMetrics:
    """The agent's own Prometheus registry (never the global default)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.in_flight = Gauge(
            "macpool_agent_in_flight_requests",
            "Requests in flight through the gateway, each generation counted (several prompts, n > 1)",
            registry=r,
        )
        self.capacity = Gauge("macpool_agent_capacity_requests", "Capacity the gateway enforces", registry=r)
        self.light_in_flight = Gauge(
            "macpool_agent_light_in_flight_requests",
            "Light requests (token counts, templates, tokenize) in flight through the gateway",
            registry=r,
        )
        self.requests = Counter(
            "macpool_agent_requests_total",
            "Proxied requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "macpool_agent_rejections_total",
            "Requests refused by the gateway, by reason",
            ["reason"],
            registry=r,
        )
        self.slot_choices = Counter(
            "macpool_agent_slot_choices_total",
            "Requests of a named session by the slot the gateway chose for them (node_agent/slots.py): own, "
            "ended, free, evicted, or unnamed (llama-server chose)",
            ["choice"],
            registry=r,
        )
        self.slots_found = Counter(
            "macpool_agent_slots_found_total",
            "Requests whose slot llama-server chose, found in its /slots (node_agent/slots.py)",
            registry=r,
        )
        self.upstream_errors = Counter(
            "macpool_agent_upstream_errors_total", "Upstream connection failures", ["kind"], registry=r
        )
        self.ttft = Histogram(
            "macpool_agent_ttft_seconds",
            "Time to the first upstream byte of streamed responses",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.heartbeat_failures = Counter(
            "macpool_agent_heartbeat_failures_total",
            "Heartbeats that could not be written to Redis",
            registry=r,
        )
        self.restarts = Counter(
            "macpool_agent_llama_server_restarts_total", "Restarts of the supervised llama-server", registry=r
        )
        self.pinned = Gauge("macpool_agent_pinned_memory_bytes", "Pinned (wired) memory", registry=r)
        self.wired_limit = Gauge("macpool_agent_wired_limit_bytes", "GPU wired-memory limit", registry=r)
        self.state = Gauge(
            "macpool_agent_state_info", "1 for the node's current state", ["state"], registry=r
        )
        self.superseded = Gauge(
            "macpool_agent_superseded",
            "1 while an agent started later holds this node id (this one gets no traffic), else 0",
            registry=r,
        )


@dataclass(frozen=True)
class PrefillReading:
    """How far llama-server's prompt counters and the agent's own prompt timings moved between two
    readings (node_agent/heartbeat.py prefill_reading)."""

    tokens: float  # prompt tokens processed (those a cache held left out)
    seconds: float  # llama-server's prompt seconds for them: each slot's, added
    busy: float  # seconds in which the agent had some prompt at llama-server
    summed: float  # the seconds each of those prompts waited, added up
    cached: float  # prompt tokens read from a cache instead
    prompts: int  # answers that began: prompts processed


@dataclass
class Runtime:
    """Mutable state of one agent process. Single event loop: plain ints are atomic between awaits.

    It alone writes the node's lifecycle (``state``, ``capacity``, ``admitting``, the in-flight count);
    the heartbeat, the supervisor, the gateway and the agent call its named transitions. ``draining`` is
    the last state: no transition leaves it. A standby-capable agent (``--standby``, node_agent/standby.py)
    also moves between ``standby``, ``loading`` and ``draining-to-standby`` on the autoscaler's word.
    """

    settings: AgentSettings
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    http: httpx.AsyncClient | None = None
    upstream_transport: Upstream | None = None  # the one ``http`` uses
    upstream_url: str = ""
    model: str | None = None  # one model of several: its name in llama-server's router mode (model_query)
    doc: NodeDoc | None = None
    details: dict[str, object] = field(default_factory=dict)  # extra /status figures (probe, GGUF, ...)
    sizing: Sizing | None = None  # supervise mode: llama-server's slots and why
    load_s: float | None = None  # supervise mode: how long llama-server's last start took to answer
    ttft_samples: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    slot_tokens_per_s: float | None = None  # smoothed decode speed of one answer (note_decode)
    slot_concurrency: float | None = None  # ... and the requests in flight while it was measured
    prefill_tokens_per_s: float | None = None  # prompt speed over the latest readings (note_prefill)
    prefill_depth: float | None = None  # ... and the mean depth, in tokens, it was measured at
    prefill_readings: deque[PrefillReading] = field(default_factory=lambda: deque(maxlen=PREFILL_READINGS))
    prompts_begun: int = 0  # answers whose first token came: each a prompt processed (note_ttft)
    # set to publish a heartbeat now rather than at the next tick (llama-server found dead)
    beat_now: asyncio.Event = field(default_factory=asyncio.Event)
    _state: NodeState = field(default="starting", init=False)
    _capacity: int = field(default=0, init=False)
    _total_slots: int = field(default=0, init=False)
    _admitting: bool = field(default=False, init=False)
    _in_flight: int = field(default=0, init=False)
    # when each request sent to llama-server whose answer has not begun (a prompt it is processing) was
    # sent; since when one has been; and, of the answers begun, the seconds with one and their own seconds
    _prompting: list[float] = field(default_factory=list, init=False)
    _prompting_since: float = field(default=0.0, init=False)
    _prompting_s: float = field(default=0.0, init=False)
    _prompts_s: float = field(default=0.0, init=False)
    _light_in_flight: int = field(default=0, init=False)
    # the supervised llama-server's own state until it first answers /health (None: up, or not supervised)
    _llama: NodeState | None = field(default=None, init=False)
    # the elastic phase, which the heartbeat's decision does not override: "standby" and
    # "draining-to-standby" hold; "loading" holds until the node is ready (None: an ordinary active node)
    _elastic: NodeState | None = field(default=None, init=False)
    _standby_capacity: int = field(default=0, init=False)
    last_busy: float = field(default_factory=time.monotonic, init=False)  # a request began or ended

    def __post_init__(self) -> None:
        self._llama = "starting" if self.settings.supervise else None
        if self.settings.standby:
            self._elastic = "standby"
            self._state = "standby"
        self._show_state()

    @property
    def state(self) -> NodeState:
        return self._state

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def total_slots(self) -> int:
        """llama-server's slots (/props), 0 until known."""
        return self._total_slots

    @property
    def admitting(self) -> bool:
        """False while starting, unhealthy, draining or under memory pressure."""
        return self._admitting

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def light_in_flight(self) -> int:
        """Light requests (no generation slot) in flight, against ``light_cap``."""
        return self._light_in_flight

    @property
    def draining(self) -> bool:
        return self._state == "draining"

    @property
    def standing_by(self) -> bool:
        """In standby, or on the way to it: the model is, or is about to be, unloaded."""
        return self._elastic in ("standby", "draining-to-standby")

    @property
    def standby_capacity(self) -> int:
        """The capacity this node would have once loaded (its last decided capacity while it was loaded,
        else what its settings allow)."""
        settings = self.settings
        slots = self.sizing.parallel if self.sizing else settings.parallel
        fallback = settings.cap or settings.calibrated_cap or ((slots or 0) if settings.supervise else 0)
        return self._standby_capacity or fallback

    @property
    def llama_state(self) -> NodeState | None:
        """"starting" or "unhealthy" while the supervised llama-server is not up; None otherwise."""
        return self._llama

    def capacity_decided(self, state: NodeState, capacity: int, total_slots: int) -> NodeState:
        """The heartbeat's decision; returns the state in effect (a draining node stays draining, a standby
        one in standby, a loading one loading until it is ready)."""
        self._capacity = capacity
        self._total_slots = total_slots
        self.metrics.capacity.set(capacity)
        if state == "ready" and capacity > 0:
            self._standby_capacity = capacity
        if self.draining:
            return self._state
        if self._elastic == "loading":
            if state != "ready":
                state = "loading"
            else:
                self._elastic = None
                self.last_busy = time.monotonic()  # (idle from now: the load is not idleness)
        if self._elastic is not None:
            self._admitting = False
            return self._state
        self._admitting = state == "ready"
        self._set_state(state)
        return self._state

    def activate(self) -> None:
        """The autoscaler wants this node serving: load (admitting nothing until the heartbeat finds it
        ready). From draining-to-standby the model is still loaded: the next heartbeat finds it ready."""
        if self.draining or not self.standing_by:
            return
        self._elastic = "loading"
        self.last_busy = time.monotonic()
        self._set_state("loading")
        self.beat_now.set()

    def begin_standby_drain(self) -> None:
        """The autoscaler wants this node in standby: admit nothing new, finish what it holds."""
        if self.draining or self.standing_by:
            return
        self._elastic = "draining-to-standby"
        self._admitting = False
        self._set_state("draining-to-standby")
        self.beat_now.set()

    def enter_standby(self) -> None:
        """Drained (and llama-server stopped, when supervised): registered, holding no model."""
        if self.draining:
            return
        self._elastic = "standby"
        self._admitting = False
        if self.settings.supervise:
            self._llama = "starting"  # stopped: "starting" again until the next one answers /health
        self._set_state("standby")
        self.beat_now.set()

    def llama_up(self, load_s: float | None = None) -> None:
        """The supervised llama-server answers /health, ``load_s`` after it started: the next heartbeat
        decides from its figures."""
        self._llama = None
        if load_s is not None:
            self.load_s = load_s

    def llama_down(self) -> None:
        """The supervised llama-server exited (it is restarted): unhealthy until it answers again."""
        self._llama = "unhealthy"
        self.metrics.restarts.inc()
        if not self.draining and self._elastic is None:
            self._set_state("unhealthy")
        self.upstream_lost()

    def llama_resizing(self) -> None:
        """llama-server is restarted on purpose with other slots: "starting" until it answers."""
        self._llama = "starting"
        self.upstream_lost()

    def upstream_lost(self) -> None:
        """llama-server stopped answering: admit nothing more and tell the routers at once, not at the next
        heartbeat (which also decides when it is back)."""
        self._admitting = False
        self.beat_now.set()

    def begin_drain(self) -> None:
        """Admit nothing new, for good: the node only finishes what it holds."""
        self._admitting = False
        self._set_state("draining")

    def hold(self, slots: int) -> None:
        """Count ``slots`` more against the cap (the gateway has checked that they fit)."""
        self._in_flight += slots
        self.last_busy = time.monotonic()
        self.metrics.in_flight.set(self._in_flight)

    def release(self, slots: int) -> None:
        """The request holding ``slots`` ended."""
        self.hold(-slots)

    def hold_light(self, count: int = 1) -> None:
        """Count a light request more against the light cap (the gateway has checked that it fits)."""
        self._light_in_flight += count
        self.last_busy = time.monotonic()
        self.metrics.light_in_flight.set(self._light_in_flight)

    def release_light(self) -> None:
        """A light request ended."""
        self.hold_light(-1)

    def client(self) -> httpx.AsyncClient:
        if self.http is None:
            raise RuntimeError("the upstream client is not open")
        return self.http

    def transport(self) -> Upstream:
        """The client's transport, which the gateway relays through (node_agent/gateway.py ``_send``)."""
        if self.upstream_transport is None:
            raise RuntimeError("the upstream client is not open")
        return self.upstream_transport

    def ttft_p50_ms(self) -> float | None:
        return statistics.median(self.ttft_samples) * 1000 if self.ttft_samples else None

    def note_decode(self, gaps: list[float], concurrency: float) -> None:
        """One streamed answer's tokens came ``gaps`` seconds apart after the first, while about
        ``concurrency`` requests ran here. One slot's decode speed is one over the median gap: a step that
        also processes another request's prompt holds every stream for that prompt's time, and routers
        count those prompts apart (one per request running, router/placement.py), so the median leaves
        them out. Short answers say too little and are left out. Routers scale the speed to the
        concurrency a new request would meet, so speed and concurrency are smoothed alike."""
        if len(gaps) < MIN_DECODE_EVENTS - 1:
            return
        gap = statistics.median(gaps)
        if gap <= 0:
            return
        rate = 1.0 / gap
        if self.slot_tokens_per_s is None or self.slot_concurrency is None:
            self.slot_tokens_per_s, self.slot_concurrency = rate, concurrency
            return
        self.slot_tokens_per_s += DECODE_EWMA * (rate - self.slot_tokens_per_s)
        self.slot_concurrency += DECODE_EWMA * (concurrency - self.slot_concurrency)

    def note_prefill(self, reading: PrefillReading) -> None:
        """What a request's prefill costs here, which routers weigh against the prompt they would send: the
        prompt tokens llama-server processed over the latest readings, over the seconds the Mac took for them
        (llama-server's, each slot's added, brought to the Mac's by how much the agent saw its prompts
        overlap), and the mean depth they sat at (a token deep in a prompt costs more: router/placement.py).
        Summed over the readings, not averaged: a prompt's seconds all come into the reading in which it
        finished, while its wait went into every reading it spanned, so one reading alone may say the Mac is
        many times faster or slower than it is; over several such splits cancel."""
        self.prefill_readings.append(reading)
        readings = self.prefill_readings
        tokens, seconds = sum(r.tokens for r in readings), sum(r.seconds for r in readings)
        busy, summed = sum(r.busy for r in readings), sum(r.summed for r in readings)
        took = seconds * min(1.0, busy / summed) if summed > 0 else seconds
        if tokens <= 0 or took <= 0:
            return
        self.prefill_tokens_per_s = tokens / took
        cached, prompts = sum(r.cached for r in readings), sum(r.prompts for r in readings)
        self.prefill_depth = (cached + tokens / 2) / max(1, prompts)

    def prompt_sent(self) -> float:
        """A request went to llama-server, which answers once its prompt is processed: the time it was sent,
        for :meth:`prompt_answered`."""
        now = time.monotonic()
        if not self._prompting:
            self._prompting_since = now
        self._prompting.append(now)
        return now

    def prompt_answered(self, sent: float) -> None:
        """llama-server's answer to the request sent at ``sent`` began (or the request ended without one)."""
        now = time.monotonic()
        self._prompting.remove(sent)
        self._prompts_s += now - sent
        if not self._prompting:
            self._prompting_s += now - self._prompting_since

    def prompt_overlap(self) -> tuple[float, float]:
        """Seconds so far in which llama-server had a prompt to process, and the seconds of every prompt
        added up. Their ratio says how much prompts were processed side by side: llama-server's own prompt
        seconds add each slot's, so its tokens over them is one slot's share of the Mac, not what the Mac
        processes (routers weigh the prompts ahead of a request at the Mac's speed)."""
        now = time.monotonic()
        running = now - self._prompting_since if self._prompting else 0.0
        return self._prompting_s + running, self._prompts_s + sum(now - sent for sent in self._prompting)

    def note_ttft(self, seconds: float) -> None:
        """An answer's first token came ``seconds`` after its request was sent on: its prompt is processed."""
        self.prompts_begun += 1
        self.ttft_samples.append(seconds)
        self.metrics.ttft.observe(seconds)

    def _set_state(self, state: NodeState) -> None:
        self._state = state
        self._show_state()

    def _show_state(self) -> None:
        for name in NODE_STATES:
            self.metrics.state.labels(name).set(1 if name == self._state else 0)
