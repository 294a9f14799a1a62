"""``macpool bench affinity``: multi-turn chats with long histories, prefix-cache affinity on versus off.

The pool: a real Redis-protocol server, ``--nodes`` simulated Macs (``m5max-128g-14b-q4``, ``--parallel``
slots each, metrics on), an agent per Mac capped at ``--cap`` (default: its slot count), and one router.
The workload: as many conversations in flight as the pool admits at once (``--clients`` to change it), each a
closed loop of chats. A conversation opens with a long
document of its own (``--doc-tokens``) as the system message; every turn sends the previous turn's messages
plus the assistant's reply plus a new user message, so the whole history is a prefix of the next prompt and
a slot that still holds it only prefills the new tail (the simulator models llama-server's per-slot cache).
Each client runs ``--per-client`` conversations of ``--turns`` turns, one after another, with a short think
time between turns. Turn sizes come from a fixed seed, so both runs send the same shape of work.

The workload runs twice on the same nodes: through a router with affinity on, then through a fresh router
started with ``--no-affinity``. Between runs the simulators go idle and are reset (``/sim/reset``), and every
text carries a per-run salt, so nothing one run cached can help the other.

Per run, in simulated time: TTFT p50/p99 (from the first attempt, so time spent rejected counts), aggregate
throughput (tokens the simulators generated per simulated second while every client was still busy), the
simulators' ``llamacpp:prompt_tokens_cached_total`` over the run, how often a follow-up turn went to the
node that served the conversation's previous turn, and the router's ``macpool_affinity_total`` counters when
it exports them. Keys: ``ttft_p50_ratio`` (off / on; target >= 2) and ``throughput_ratio`` (on / off; target
>= 0.95, "no loss").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool.bench.report import run_and_report
from macpool.bench.sse import Events, delta_text
from macpool.bench.stack import Stack
from macpool.bench.stats import pct
from macpool.dev.procs import macpool_argv
from macpool.dev.redis_server import free_port
from macpool.dev.stack import Proc, wait_nodes
from macpool.sim import tokens

PRESET = "m5max-128g-14b-q4"
TARGET_TTFT_RATIO = 2.0
TARGET_THROUGHPUT_RATIO = 0.95
SEED = 9
REJECT_PAUSE_S = 0.2  # wall seconds before a rejected turn is sent again (Retry-After, if shorter)
MAX_ATTEMPTS = 50
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", re.MULTILINE)
_LABEL_VALUE = re.compile(r'="([^"]*)"')


@dataclass
class Conditions:
    nodes: int = 3
    parallel: int = 4  # slots per simulated Mac
    cap: int = 0  # each agent's cap; 0: the slots (a bigger -np than cap keeps more histories cached)
    clients: int = 0  # conversations in flight; 0: what the pool admits at once (nodes x cap)
    per_client: int = 3  # conversations each client holds, one after another
    turns: int = 6
    doc_tokens: int = 3000  # the conversation's own document (system message)
    user_tokens: int = 80  # a user message, drawn from 0.5x..1.5x
    reply_tokens: int = 128  # an assistant reply (max_tokens), drawn from 0.5x..1.5x
    think_s: float = 1.0  # simulated seconds between a reply and the next turn, drawn from 0.5x..1.5x
    speed: float = 1.0  # simulated seconds per wall second (faster: the Python relay chain lags, see docs)
    max_wall_s: float = 150.0  # per run: no new turn starts after this many wall seconds
    preset: str = PRESET

    @property
    def node_cap(self) -> int:
        return self.cap or self.parallel

    @property
    def in_flight(self) -> int:
        return self.clients or self.nodes * self.node_cap

    @property
    def ctx_per_slot(self) -> int:
        longest = self.doc_tokens + self.turns * 1.5 * (self.user_tokens + self.reply_tokens + 10) + 64
        return max(8192, 1024 * -(-int(longest) // 1024))


@dataclass
class Turn:
    """One chat request as the client saw it (wall seconds)."""

    client: int
    conversation: int
    turn: int
    status: int  # 0 when the connection failed
    ttft_s: float | None
    latency_s: float
    tokens: int
    node: str
    attempts: int
    prompt_tokens: int  # the rendered prompt, by the simulator's tokenizer
    reusable_tokens: int  # of those, the previous turn's prompt and reply (what a slot may still hold)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class Script:
    """The shape of one conversation: sizes and think times, the same in both runs."""

    user_tokens: list[int]
    reply_tokens: list[int]
    think_s: list[float]

    @classmethod
    def draw(cls, c: Conditions, client: int, conversation: int) -> Script:
        rng = random.Random(f"{SEED}-{client}-{conversation}")

        def around(mean: float) -> float:
            return mean * rng.uniform(0.5, 1.5)

        return cls(
            user_tokens=[max(1, round(around(c.user_tokens))) for _ in range(c.turns)],
            reply_tokens=[max(1, round(around(c.reply_tokens))) for _ in range(c.turns)],
            think_s=[around(c.think_s) for _ in range(c.turns)],
        )


def _user_text(n_tokens: int, salt: str) -> str:
    return tokens.make_prompt(n_tokens, salt).replace("Summarise the following notes", "And what about")


@dataclass
class Answer:
    """What one attempt at a turn got back."""

    status: int
    node: str = ""
    ttft_s: float | None = None  # from the turn's first attempt
    text: str = ""
    chunks: int = 0
    hint: str = ""  # Retry-After of a 503, or the start of an error body


async def chat_turn(http: httpx.AsyncClient, body: dict[str, Any], started: float) -> Answer:
    """One streamed chat completion, read to the end."""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        answer = Answer(response.status_code, response.headers.get("x-macpool-node", ""))
        if response.status_code != 200:
            await response.aread()
            is_503 = response.status_code == 503
            answer.hint = response.headers.get("retry-after", "") if is_503 else response.text[:200]
            return answer
        parts: list[str] = []
        async for doc in Events(response):
            text = delta_text(doc)
            if text:
                if answer.ttft_s is None:
                    answer.ttft_s = time.monotonic() - started
                parts.append(text)
        answer.text, answer.chunks = "".join(parts), len(parts)
    return answer


@dataclass
class Workload:
    """Every client's conversations against one router; ``done`` is set when the first client finishes."""

    conditions: Conditions
    router: str
    salt: str
    deadline: float
    turns: list[Turn] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    rejected_503: int = 0

    async def run(self) -> list[Turn]:
        n = self.conditions.in_flight
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        timeout = httpx.Timeout(300.0, connect=10.0)
        async with httpx.AsyncClient(base_url=self.router, limits=limits, timeout=timeout) as http:
            await asyncio.gather(*(self.client(http, i) for i in range(n)))
        return self.turns

    async def client(self, http: httpx.AsyncClient, client: int) -> None:
        c = self.conditions
        # spread the first turns over about one think time, as people do not all start at once
        await asyncio.sleep(c.think_s * client / c.in_flight / c.speed)
        try:
            for conversation in range(c.per_client):
                if not await self.conversation(http, client, conversation):
                    return
        finally:
            self.done.set()

    async def conversation(self, http: httpx.AsyncClient, client: int, conversation: int) -> bool:
        """One conversation, turn after turn; False once the run's deadline has passed."""
        c = self.conditions
        script = Script.draw(c, client, conversation)
        tag = f"{self.salt}-c{client}-v{conversation}"
        messages = [{"role": "system", "content": tokens.make_prompt(c.doc_tokens, f"{tag} document")}]
        reusable = 0
        for turn in range(c.turns):
            if time.monotonic() >= self.deadline:
                return False
            question = _user_text(script.user_tokens[turn], f"{tag}-t{turn}")
            messages.append({"role": "user", "content": question})
            body = {
                "messages": messages, "max_tokens": script.reply_tokens[turn], "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
            }
            prompt = tokens.render_chat(messages)
            record, reply = await self.send(http, body, client, conversation, turn)
            record.prompt_tokens, record.reusable_tokens = tokens.count(prompt), reusable
            self.turns.append(record)
            if not record.ok:
                return True  # the history is broken: this conversation ends, the client goes on
            messages.append({"role": "assistant", "content": reply})
            reusable = tokens.count(prompt + reply)
            await asyncio.sleep(script.think_s[turn] / c.speed)
        return True

    async def send(
        self, http: httpx.AsyncClient, body: dict[str, Any], client: int, conversation: int, turn: int
    ) -> tuple[Turn, str]:
        """Send one turn until it is not rejected; TTFT and latency count from the first attempt."""
        started = time.monotonic()
        answer, error, attempts = Answer(0), None, 0
        while attempts < MAX_ATTEMPTS:
            attempts += 1
            try:
                answer = await chat_turn(http, body, started)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                answer, error = Answer(0), type(exc).__name__
                break
            if answer.status != 503:
                break
            self.rejected_503 += 1
            await asyncio.sleep(_pause(answer.hint))
        if answer.status not in (0, 200):
            error = f"HTTP {answer.status}: {answer.hint}"
        record = Turn(
            client=client, conversation=conversation, turn=turn, status=answer.status, ttft_s=answer.ttft_s,
            latency_s=time.monotonic() - started, tokens=answer.chunks, node=answer.node, attempts=attempts,
            prompt_tokens=0, reusable_tokens=0, error=error,
        )
        return record, answer.text


def _pause(retry_after: str) -> float:
    try:
        return min(REJECT_PAUSE_S, float(retry_after))
    except ValueError:
        return REJECT_PAUSE_S


# --- the pool and the two runs ---------------------------------------------------------------------


def samples(text: str, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` in Prometheus text: its label string ("" for none) -> value."""
    return {labels: float(value) for metric, labels, value in _SAMPLE.findall(text) if metric == name}


@dataclass
class SimFigures:
    """One simulator's counters at one moment."""

    sim_time_s: float
    tokens_predicted: int
    processing: int
    prompt_tokens_cached: float
    prompt_tokens_processed: float


async def read_sim(http: httpx.AsyncClient, url: str) -> SimFigures:
    stats = (await http.get(url + "/sim/stats")).json()
    text = (await http.get(url + "/metrics")).text
    return SimFigures(
        sim_time_s=float(stats["sim_time_s"]),
        tokens_predicted=int(stats["tokens_predicted_total"]),
        processing=int(stats["processing"]),
        prompt_tokens_cached=samples(text, "llamacpp:prompt_tokens_cached_total").get("", 0.0),
        prompt_tokens_processed=samples(text, "llamacpp:prompt_tokens_total").get("", 0.0),
    )


class Pool:
    """What both runs share: Redis, the simulated Macs and their agents. Routers come and go per run."""

    def __init__(self, stack: Stack, conditions: Conditions) -> None:
        self.stack = stack
        self.conditions = conditions
        self.redis_url = ""
        self.sims: dict[str, str] = {}  # node id -> simulator URL

    def start(self) -> None:
        c = self.conditions
        self.redis_url = self.stack.start_redis()
        for i in range(c.nodes):
            port = free_port()
            argv = macpool_argv(
                "sim", "--preset", c.preset, "--parallel", str(c.parallel),
                "--ctx-size", str(c.parallel * c.ctx_per_slot), "--speed", str(c.speed), "--metrics",
                "--port", str(port),
            )
            sim = self.stack.spawn(f"sim-{i}", argv, port)
            self.stack.agent(f"agent-{i}", sim.url, self.redis_url, f"mac-{i}", cap=c.node_cap)
            self.sims[f"mac-{i}"] = sim.url

    def router(self, name: str, affinity: bool) -> Proc:
        router = self.stack.router(name, self.redis_url, *(() if affinity else ("--no-affinity",)))
        wait_nodes(router.url, self.conditions.nodes)
        return router


async def measure(name: str, router: Proc, pool: Pool, log: Callable[[str], None]) -> dict[str, Any]:
    """One run of the workload through ``router``, the simulators idle and reset first."""
    c = pool.conditions
    urls = list(pool.sims.values())
    async with httpx.AsyncClient(timeout=10) as http:
        await _until_idle(http, urls)
        for url in urls:
            await http.post(url + "/sim/reset")
        # the wall time spans every read of the simulators' clocks, so that their time over it never seems to
        # run ahead of --speed however long a read takes on a loaded machine
        read0 = time.monotonic()
        before = [await read_sim(http, url) for url in urls]
        wall0 = time.monotonic()
        workload = Workload(c, router.url, f"{name}-{secrets.token_hex(4)}", wall0 + c.max_wall_s)
        running = asyncio.create_task(workload.run())
        await workload.done.wait()  # the first client is through: the end of the all-busy window
        window = [await read_sim(http, url) for url in urls]
        turns = await running
        after = [await read_sim(http, url) for url in urls]
        wall = time.monotonic() - read0
        router_metrics = (await http.get(router.url + "/metrics")).text
    log(f"{name}: {len(turns)} turns in {wall:.0f} wall s")
    return summarise(name, workload, pool, before, window, after, wall, router_metrics)


async def _until_idle(http: httpx.AsyncClient, urls: list[str], within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        figures = [await read_sim(http, url) for url in urls]
        if all(f.processing == 0 for f in figures):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the simulators were still busy after {within_s}s")


def summarise(
    name: str, workload: Workload, pool: Pool, before: list[SimFigures], window: list[SimFigures],
    after: list[SimFigures], wall_s: float, router_metrics: str,
) -> dict[str, Any]:
    c = pool.conditions
    turns = workload.turns
    ok = [t for t in turns if t.ok]
    sim_s = _mean([b.sim_time_s - a.sim_time_s for a, b in zip(before, after, strict=True)])
    scale = sim_s / wall_s  # simulated seconds per wall second, as achieved
    window_s = _mean([b.sim_time_s - a.sim_time_s for a, b in zip(before, window, strict=True)])
    generated = sum(b.tokens_predicted - a.tokens_predicted for a, b in zip(before, window, strict=True))
    cached = {
        node: round(b.prompt_tokens_cached - a.prompt_tokens_cached)
        for node, a, b in zip(pool.sims, before, after, strict=True)
    }
    processed = sum(
        b.prompt_tokens_processed - a.prompt_tokens_processed for a, b in zip(before, after, strict=True)
    )

    def ttft(subset: list[Turn], p: float) -> float | None:
        value = pct([t.ttft_s * scale for t in subset if t.ttft_s is not None], p)
        return None if value is None else round(value, 3)

    follow_ups = [t for t in ok if t.turn > 0]
    previous = {(t.client, t.conversation, t.turn): t.node for t in ok}
    same = [previous.get((t.client, t.conversation, t.turn - 1)) == t.node for t in follow_ups]
    per_node: dict[str, int] = {}
    for t in ok:
        per_node[t.node] = per_node.get(t.node, 0) + 1
    affinity = {  # outcome -> count
        ",".join(_LABEL_VALUE.findall(labels)) or "total": round(value)
        for labels, value in samples(router_metrics, "macpool_affinity_total").items()
    }
    sent = sum(t.prompt_tokens for t in ok)
    return {
        "name": name,
        "turns": len(turns),
        "completed": len(ok),
        "errors": len(turns) - len(ok),
        "error_sample": sorted({t.error or f"HTTP {t.status}" for t in turns if not t.ok})[:3],
        "rejected_503": workload.rejected_503,
        "truncated": len(turns) < c.in_flight * c.per_client * c.turns,
        "ttft_p50_s": ttft(ok, 50),
        "ttft_p99_s": ttft(ok, 99),
        "ttft_p50_first_turn_s": ttft([t for t in ok if t.turn == 0], 50),
        "ttft_p50_follow_up_s": ttft(follow_ups, 50),
        "latency_p50_s": _round(pct([t.latency_s * scale for t in ok], 50)),
        "throughput_tok_s": round(generated / window_s, 1) if window_s > 0 else 0.0,
        "throughput_window_sim_s": round(window_s, 1),
        "follow_ups_on_previous_node": round(sum(same) / len(same), 4) if same else None,
        "turns_per_node": dict(sorted(per_node.items())),
        "prompt_tokens_cached_total": sum(cached.values()),
        "prompt_tokens_cached_per_node": cached,
        "prompt_tokens_processed_total": round(processed),
        "cached_share": round(sum(cached.values()) / sent, 4) if sent else None,
        "reusable_share": round(sum(t.reusable_tokens for t in ok) / sent, 4) if sent else None,
        "router_affinity_total": affinity or None,
        "sim_seconds": round(sim_s, 1),
        "wall_seconds": round(wall_s, 1),
        "speed_achieved": round(scale, 3),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def run(c: Conditions, stack: Stack, log: Callable[[str], None]) -> dict[str, Any]:
    pool = Pool(stack, c)
    pool.start()
    log(f"pool: {c.nodes} x {c.preset} (--parallel {c.parallel}, agents capped at {c.node_cap}); "
        f"{c.in_flight} conversations in flight, {c.per_client} each, {c.turns} turns, speed {c.speed:g}")
    runs: list[dict[str, Any]] = []
    for name, affinity in (("affinity_on", True), ("affinity_off", False)):
        router = pool.router(f"router-{name}", affinity)
        try:
            runs.append(asyncio.run(measure(name, router, pool, log)))
        finally:
            router.child.stop(timeout=10)
    on, off = runs
    ttft_ratio = _ratio(off["ttft_p50_s"], on["ttft_p50_s"])
    throughput_ratio = _ratio(on["throughput_tok_s"], off["throughput_tok_s"])
    return {
        "bench": "affinity",
        "ttft_p50_ratio": ttft_ratio,
        "ttft_p99_ratio": _ratio(off["ttft_p99_s"], on["ttft_p99_s"]),
        "throughput_ratio": throughput_ratio,
        "target": {"ttft_p50_ratio": TARGET_TTFT_RATIO, "throughput_ratio": TARGET_THROUGHPUT_RATIO},
        "target_met": bool(
            ttft_ratio is not None and ttft_ratio >= TARGET_TTFT_RATIO
            and throughput_ratio is not None and throughput_ratio >= TARGET_THROUGHPUT_RATIO
        ),
        "conditions": {
            **asdict(c), "node_cap": c.node_cap, "in_flight": c.in_flight, "ctx_per_slot": c.ctx_per_slot,
        },
        "runs": {r["name"]: r for r in runs},
    }


def parser() -> argparse.ArgumentParser:
    d = Conditions()
    p = argparse.ArgumentParser(prog="macpool bench affinity", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=d.nodes, help="simulated Macs")
    p.add_argument("--parallel", type=int, default=d.parallel, help="slots per Mac")
    p.add_argument("--cap", type=int, default=d.cap, help="each agent's cap (0: the slots)")
    p.add_argument("--clients", type=int, default=d.clients, help="conversations in flight (0: nodes x cap)")
    p.add_argument("--per-client", type=int, default=d.per_client, help="conversations per client, in turn")
    p.add_argument("--turns", type=int, default=d.turns, help="turns per conversation")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens, help="each conversation's document")
    p.add_argument("--user-tokens", type=int, default=d.user_tokens, help="mean user message")
    p.add_argument("--reply-tokens", type=int, default=d.reply_tokens, help="mean assistant reply")
    p.add_argument("--think", type=float, default=d.think_s, help="mean simulated seconds between turns")
    p.add_argument("--speed", type=float, default=d.speed, help="simulated seconds per wall second")
    p.add_argument("--max-wall", type=float, default=d.max_wall_s, help="wall seconds per run at most")
    p.add_argument("--preset", default=d.preset)
    p.add_argument("--json", type=Path, help="write the result as JSON here")
    p.add_argument("--logs", type=Path, help="keep the processes' logs in this directory")
    return p


def table(result: dict[str, Any]) -> str:
    rows = [
        ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"),
        ("TTFT p50 s, first turns", "ttft_p50_first_turn_s"),
        ("TTFT p50 s, follow-ups", "ttft_p50_follow_up_s"), ("latency p50 s", "latency_p50_s"),
        ("throughput tok/s", "throughput_tok_s"), ("turns completed", "completed"), ("errors", "errors"),
        ("503 (retried)", "rejected_503"), ("follow-ups on previous node", "follow_ups_on_previous_node"),
        ("prompt tokens cached", "prompt_tokens_cached_total"), ("cached share", "cached_share"),
        ("reusable share (ideal)", "reusable_share"), ("speed achieved", "speed_achieved"),
    ]
    on, off = result["runs"]["affinity_on"], result["runs"]["affinity_off"]
    lines = [f"{'(simulated time)':<30} {'affinity on':>14} {'affinity off':>14}"]
    lines += [f"{label:<30} {on[key]!s:>14} {off[key]!s:>14}" for label, key in rows]
    lines.append(f"{'router affinity counters':<30} {on['router_affinity_total']!s:>14}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    c = Conditions(
        nodes=args.nodes, parallel=args.parallel, cap=args.cap, clients=args.clients,
        per_client=args.per_client, turns=args.turns, doc_tokens=args.doc_tokens,
        user_tokens=args.user_tokens, reply_tokens=args.reply_tokens, think_s=args.think, speed=args.speed,
        max_wall_s=args.max_wall, preset=args.preset,
    )
    details = ("conditions", "runs")  # left out of the printed summary line
    return run_and_report(lambda stack, say: run(c, stack, say), table, args.logs, args.json, details)
