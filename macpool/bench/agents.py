"""``macpool bench agents``: coding-agent sessions on a mixed pool of Macs, macpool beside nginx and LiteLLM.

The pool: three simulated Macs serving Qwen3-Coder-30B (docs/simulator.md, the coding presets) - an M2 Pro
(4 slots over 32K unified KV cells), an M4 Max (4 over 128K unified) and an M2 Ultra (8 slots of 64K,
``-np 8 -c 524288``) - each started with ``-n 8192`` (docs/clients.md: Codex sends no output limit) and the
prompt cache in host memory ``macpool agent run`` gives that Mac (``--cache-ram``, node_agent/sizing.py). In
front of the same simulators, in turn and in one run:

- ``macpool``: Redis, an agent per Mac (``--cap`` its slots) and a router (``--queue-size 256
  --queue-timeout 120``, ``--session-ttl`` its default in simulated seconds; placement, sessions and token
  reservation as they are by default);
- ``nginx-least-conn``: nginx, ``least_conn``, each Mac ``weight`` and ``max_conns`` its slots;
- ``nginx-sticky``: the same, ``hash "$http_x_claude_code_session_id$http_session_id" consistent`` - each
  session on one Mac, the best a proxy that reads no body can do;
- ``litellm``: the LiteLLM proxy, ``--litellm-strategy`` (default ``least-busy``), its session affinity
  (``optional_pre_call_checks: [session_affinity]``: it reads both CLIs' session headers) and its context
  window check (``enable_pre_call_checks``, each Mac's ``max_input_tokens``), ``max_parallel_requests``
  and ``weight`` each Mac's slots.

The workload (macpool/bench/agent_sessions.py): ``--sessions`` lanes, each a developer's coding agent running
sessions one after another until ``--duration`` simulated seconds have passed; half the sessions Claude
Code's (``/v1/messages``), half Codex's (``/v1/responses``), as their recorded turns send them: a first turn
of about 22K and 26.5K tokens, each later turn the whole history plus 1-4K tokens of tool output, answers of
128-512 tokens (Codex: 256), 2-12 s of tool time between turns; every request with its CLI's session
headers. The plan is drawn from ``--seed`` and is the same for every router. A request is retried as its
CLI retries it; a turn that fails ends its session (its user compacts it or starts over).

Every router gets the same plan, ``--rounds`` times, the order reversed every other round. The simulators
keep no call to clear their caches: before each run they go idle and ``/sim/reset``, and every text of the
run carries the run's number at its start (Claude Code's billing line, Codex's instructions), so no run
finds another's prompts in a cache.

Per router: turn TTFT p50 and p99 (simulated seconds from a turn's first request to its answer's first token;
a turn still waiting at the end counts its wait so far), completed turns per minute, context errors (a 400
for a prompt over a Mac's context), other errors (out of KV cells, 5xx, broken streams), refusals (429, 503,
529, retried), and the share of prompt tokens read from a cache (the answers' ``cached_tokens`` /
``cache_read_input_tokens``); and each Mac's busy share (the part of the measured window its simulator spent
stepping: whether the pool had room for more). The bounds: each turn alone on an idle M2 Ultra whose slot
holds the session's history (the least TTFT any router can give it); and the most turns a minute any router
can complete: every lane's turns at that pace, or about what the Macs can step (``capacity``: each busy all
the time, each turn at the least it costs there on average), whichever is less.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from macpool.bench.agent_sessions import Floors, Session, Shapes, TurnRecord, Workload, drive, plan
from macpool.bench.peers import PeerError, ensure_litellm, ensure_nginx, litellm_version
from macpool.bench.stats import pct
from macpool.dev.procs import ProcessError
from macpool.dev.redis_server import free_port
from macpool.dev.stack import Proc, Stack
from macpool.sim import tokens
from macpool.sim.machine import load_preset

MODEL = "qwen3-coder"
N_PREDICT = 8192  # llama-server's -n: the answer a request without a limit may have (what macpool reserves)
ROUTER_FLAGS = ("--queue-size", "256", "--queue-timeout", "120")
# the router's and the agents' --session-ttl default, in simulated seconds (they keep wall time)
SESSION_TTL_S = 300.0
ROUTERS = ("macpool", "nginx-least-conn", "nginx-sticky", "litellm")
LITELLM_STRATEGIES = ("simple-shuffle", "least-busy", "usage-based-routing-v2", "latency-based-routing")
# macpool against the best peer: TTFT p50 and p99 this many times lower, turns a minute this many times more
TARGETS = {"ttft_p50_s": 2.0, "ttft_p99_s": 5.0, "turns_per_min": 1.3}
IDLE_TIMEOUT_S = 180.0
Say = Callable[[str], None]  # where progress lines go


@dataclass(frozen=True)
class Mac:
    name: str
    preset: str
    slots: int
    context: int  # the tokens one request may hold
    cells: int  # the KV cells of all its slots
    # the prompt cache in host memory `macpool agent run` gives its llama-server (--cache-ram: the RAM its
    # weights, KV cache, the default 2 GB of headroom and 8 GB of host reserve leave, node_agent/sizing.py),
    # from the preset's figures: the same for every router (tests/bench/test_agents_bench.py checks it)
    cache_ram_mib: int
    args: tuple[str, ...] = ()


MACS = (
    Mac("m2pro", "m2pro-32g-coder30b-q4", 4, 32_768, 32_768, 2_444),
    Mac("m4max", "m4max-64g-coder30b-q4", 4, 131_072, 131_072, 25_996),
    Mac("m2ultra", "m2ultra-192g-coder30b-q4", 8, 65_536, 524_288, 120_204, ("-np", "8", "-c", "524288")),
)
FASTEST = MACS[2]  # fastest prefill and decode: the bounds are taken on it


@dataclass(frozen=True)
class Conditions:
    workload: Workload = field(default_factory=Workload)
    duration_s: float = 900.0  # simulated seconds of each run
    warmup_s: float = 300.0  # ... of which the first are not measured: every lane's first session begins
    speed: float = 10.0
    rounds: int = 1
    routers: tuple[str, ...] = ROUTERS
    litellm: tuple[str, ...] = ("least-busy",)

    @property
    def sessions_per_lane(self) -> int:
        # more than a lane can get through: a session takes at least a minute
        return max(2, int(self.duration_s // 60) + 2)


# --- the routers ----------------------------------------------------------------------------------------


def start_sims(stack: Stack, speed: float) -> list[Proc]:
    return [
        stack.sim(f"sim-{mac.name}", "--preset", mac.preset, *mac.args, "--alias", MODEL,
                  "--cache-ram", str(mac.cache_ram_mib), "--speed", str(speed),
                  "--metrics", "--metrics-clock", "wall", "-n", str(N_PREDICT))
        for mac in MACS
    ]


def router_flags(speed: float) -> tuple[str, ...]:
    return (*ROUTER_FLAGS, "--session-ttl", f"{SESSION_TTL_S / speed:g}")


def start_macpool(stack: Stack, sims: list[Proc], speed: float) -> Proc:
    redis_url = stack.redis()
    for mac, sim in zip(MACS, sims, strict=True):
        stack.agent(f"agent-{mac.name}", sim.url, redis_url, mac.name, "--cap", str(mac.slots),
                    "--session-ttl", f"{SESSION_TTL_S / speed:g}", "--log-level", "warning")
    router = stack.router("router", redis_url, *router_flags(speed), "--log-level", "warning")
    stack.wait_nodes(router.url, len(MACS), timeout=60, exact=True)
    return router


def nginx_conf(folder: Path, sims: list[Proc], ports: dict[str, int]) -> str:
    servers = "".join(
        f"    server {sim.url.removeprefix('http://')} weight={mac.slots} max_conns={mac.slots};\n"
        for mac, sim in zip(MACS, sims, strict=True)
    )
    balance = {"least": "least_conn;",
               "sticky": 'hash "$http_x_claude_code_session_id$http_session_id" consistent;'}
    upstreams = "".join(f"  upstream {name} {{\n    {rule}\n{servers}    keepalive 64;\n  }}\n"
                        for name, rule in balance.items())
    location = ("    location / {{ proxy_pass http://{0}; proxy_http_version 1.1;"
                ' proxy_set_header Connection ""; proxy_buffering off; proxy_request_buffering off;'
                " proxy_read_timeout 3600s; }}\n")
    listen = "".join(f"  server {{\n    listen 127.0.0.1:{ports[name]};\n    client_max_body_size 64m;\n"
                     + location.format(name) + "  }\n" for name in balance)
    temp = "".join(f"  {name}_temp_path {folder}/{name};\n"
                   for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"worker_processes 1;\ndaemon off;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log warn;\n"
            "events { worker_connections 4096; }\nhttp {\n  access_log off;\n" + temp + upstreams + listen
            + "}\n")


def start_nginx(stack: Stack, binary: str, sims: list[Proc]) -> dict[str, str]:
    """One nginx serving both ways of balancing, each on a port of its own: name -> URL."""
    folder = stack.logs / "nginx"
    folder.mkdir(exist_ok=True)
    ports = {"least": free_port(), "sticky": free_port()}
    path = folder / "nginx.conf"
    path.write_text(nginx_conf(folder, sims, ports))
    try:
        stack.spawn("nginx", [binary, "-c", str(path), "-p", str(folder)], ports["least"], ready=None)
    except ProcessError as exc:
        raise PeerError(f"nginx did not start: {str(exc).splitlines()[0]}") from None
    urls = {"nginx-least-conn": f"http://127.0.0.1:{ports['least']}",
            "nginx-sticky": f"http://127.0.0.1:{ports['sticky']}"}
    for url in urls.values():
        _wait_answering(url)
    return urls


def _wait_answering(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url + "/health", timeout=2)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise PeerError(f"nothing answers on {url}") from None
            time.sleep(0.2)


def litellm_config(sims: list[Proc], strategy: str) -> str:
    lines = ["model_list:"]
    for mac, sim in zip(MACS, sims, strict=True):
        lines += [
            f"  - model_name: {MODEL}",
            "    litellm_params:",
            f"      model: openai/{MODEL}",
            f"      api_base: {sim.url}/v1",
            "      api_key: none",
            f"      max_parallel_requests: {mac.slots}",
            f"      weight: {mac.slots}",
            "    model_info:",
            f"      id: {mac.name}",
            f"      max_input_tokens: {mac.context}",
        ]
    lines += [
        "router_settings:",
        f"  routing_strategy: {strategy}",
        "  enable_pre_call_checks: true",  # a prompt goes only where its context fits (max_input_tokens)
        '  optional_pre_call_checks: ["session_affinity"]',  # a session stays where it began
        "litellm_settings:",
        "  drop_params: true",
        "  telemetry: false",
        "  request_timeout: 3600",
    ]
    return "\n".join(lines) + "\n"


def start_litellm(stack: Stack, binary: Path, sims: list[Proc], strategy: str) -> Proc:
    config = stack.logs / f"litellm-{strategy}.yaml"
    config.write_text(litellm_config(sims, strategy))
    port = free_port()
    argv = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR",
           # no client auth, as for macpool and nginx here (loopback only)
           "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    try:
        return stack.spawn(f"litellm-{strategy}", argv, port, ready="/health/liveliness", timeout=240,
                           env=env)
    except ProcessError as exc:
        raise PeerError(f"the LiteLLM proxy did not start: {str(exc).splitlines()[0]}") from None


def router_names(c: Conditions) -> list[str]:
    names = [name for name in c.routers if name != "litellm"]
    if "litellm" in c.routers:
        names += ["litellm" if len(c.litellm) == 1 else f"litellm {s}" for s in c.litellm]
    return names


# --- warming up, between runs ---------------------------------------------------------------------------


def warm_up(agents: list[str], router: str, say: Say) -> None:
    """A few answers through each agent, so that each measures its Mac's first token, slot speed and prompt
    speed (the router places by them); then until the router sees them all."""
    body = {"model": MODEL, "max_tokens": 48, "stream": True}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            for round_ in range(3):
                await asyncio.gather(*(
                    http.post(url + "/v1/chat/completions", json=body | {
                        "messages": tokens.chat_messages(3000, salt=f"warm-{round_}-{i}")})
                    for i, url in enumerate(agents)
                ))

    say("warm-up: three answers on each Mac through its agent ...")
    asyncio.run(go())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        nodes = httpx.get(router + "/api/pool", timeout=5).json()["nodes"]
        if len(nodes) == len(MACS) and all(n.get("slot_tokens_per_s") and n.get("prefill_tokens_per_s")
                                           for n in nodes):
            return
        time.sleep(0.5)
    raise RuntimeError("the Macs' speeds did not reach the router after the warm-up")


def sim_stats(urls: list[str]) -> list[dict[str, Any]]:
    return [httpx.get(url + "/sim/stats", timeout=10).json() for url in urls]


def stats_after(urls: list[str], start: list[dict[str, Any]], seconds: float, speed: float,
                stop: threading.Event) -> list[dict[str, Any]] | None:
    """The simulators' stats once each one's clock has run ``seconds`` past its ``start`` stats (None:
    ``stop`` was set first), asked for about when that is due at ``speed``, so they are seldom asked."""
    wait = 0.0
    while not stop.wait(wait):
        now = sim_stats(urls)
        left = max(seconds - (s["sim_time_s"] - b["sim_time_s"]) for s, b in zip(now, start, strict=True))
        if left <= 0:
            return now
        wait = max(0.1, left / speed)
    return None


def busy_share(start: dict[str, Any], end: dict[str, Any]) -> float | None:
    """The share of the simulated time between two of a simulator's stats it spent stepping."""
    span = end["sim_time_s"] - start["sim_time_s"]
    return round((end["busy_time_s"] - start["busy_time_s"]) / span, 3) if span > 0 else None


def until_idle(urls: list[str], say: Say) -> None:
    """Until no simulator runs or defers a task (a peer may let a cut request run on)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        if all(s["processing"] == 0 and s["deferred"] == 0 for s in sim_stats(urls)):
            return
        time.sleep(0.5)
    say(f"warning: the simulators were still busy after {IDLE_TIMEOUT_S:.0f} s")


# --- one run --------------------------------------------------------------------------------------------


def measure(name: str, url: str, sims: list[str], lanes: list[list[Session]], shapes: Shapes, c: Conditions,
            run: int, say: Say) -> dict[str, Any]:
    until_idle(sims, say)
    for sim in sims:
        httpx.post(sim + "/sim/reset", timeout=10)
    before, wall0 = sim_stats(sims), time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        stop = threading.Event()
        at_warmup = pool.submit(stats_after, sims, before, c.warmup_s, c.speed, stop)
        try:
            outcome = asyncio.run(drive(url, lanes, shapes, c.workload, run, c.speed, c.duration_s))
        finally:
            stop.set()
        after, wall = sim_stats(sims), time.monotonic() - wall0
        mid = at_warmup.result() or before
    pairs = list(zip(before, after, strict=True))
    scale = statistics.mean(b["sim_time_s"] - a["sim_time_s"] for a, b in pairs) / wall
    records = [in_sim(r, scale) for r in outcome.records]
    window = Window(records, c.warmup_s, outcome.wall_s * scale, outcome.sessions_started)
    summary = summarise([window])
    summary |= {
        "run": run,
        "speed_achieved": round(scale, 3),
        "completed_by_mac": {mac.name: b["completed"] for mac, b in zip(MACS, after, strict=True)},
        "failed_tasks_by_mac": {mac.name: b["failed"] for mac, b in zip(MACS, after, strict=True)},
        "busy_by_mac": {mac.name: busy_share(m, b) for mac, m, b in zip(MACS, mid, after, strict=True)},
        "prompt_tokens_processed": sum(b["prompt_tokens_total"] - a["prompt_tokens_total"] for a, b in pairs),
    }
    say(f"run {run} {name}: {summary['turns_completed']} turns, TTFT p50 {summary['ttft_p50_s']} s "
        f"p99 {summary['ttft_p99_s']} s, {summary['turns_per_min']} turns/min, context errors "
        f"{summary['context_errors']}, other errors {summary['other_errors']} ({wall:.0f} s)")
    summary["_window"] = window
    summary["turns"] = [_turn(r) for r in records]
    return summary


def in_sim(r: TurnRecord, scale: float) -> TurnRecord:
    """A turn's times in simulated seconds (``scale``: simulated seconds per wall second, as measured)."""
    def sim(value: float | None) -> float | None:
        return None if value is None else value * scale

    return replace(r, started=r.started * scale, ttft_s=sim(r.ttft_s), ended=sim(r.ended), attempt=None)


def _turn(r: TurnRecord) -> dict[str, Any]:
    """One turn as the JSON keeps it."""
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    return {"lane": r.lane, "session": r.session, "turn": r.turn, "client": r.client,
            "start_s": rounded(r.started), "ttft_s": rounded(r.ttft_s), "end_s": rounded(r.ended), "ok": r.ok,
            "cut": r.cut, "attempts": r.attempts, "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, **({"node": r.node} if r.node else {})}


@dataclass(frozen=True)
class Window:
    """One run's turns (simulated seconds) and the part of it measured: from ``start_s`` (after the lanes'
    first sessions began) to ``end_s``."""

    records: list[TurnRecord]
    start_s: float
    end_s: float
    sessions_started: int

    @property
    def measured(self) -> list[TurnRecord]:
        return [r for r in self.records if r.started >= self.start_s]

    @property
    def completed(self) -> list[TurnRecord]:
        return [r for r in self.records if r.ok and r.ended is not None and r.ended >= self.start_s]

    @property
    def minutes(self) -> float:
        return max(0.0, self.end_s - self.start_s) / 60


def summarise(windows: list[Window]) -> dict[str, Any]:
    """The figures of one run, or of several pooled: percentiles over every measured turn, turns a minute
    over all the measured minutes."""
    recs = [r for w in windows for r in w.measured]
    ok = [r for r in recs if r.ok]
    timed = [r for r in recs if r.ttft_s is not None and (r.ok or r.cut)]
    ttft = [r.ttft_s for r in timed if r.ttft_s is not None]
    first = [r.ttft_s for r in timed if r.ttft_s is not None and r.turn == 0]
    later = [r.ttft_s for r in timed if r.ttft_s is not None and r.turn > 0]
    kinds = [kind for r in recs for kind in r.attempts]
    prompt = sum(r.prompt_tokens for r in ok)
    minutes = sum(w.minutes for w in windows)
    completed = sum(len(w.completed) for w in windows)
    return {
        "ttft_p50_s": _round(pct(ttft, 50)),
        "ttft_p99_s": _round(pct(ttft, 99)),
        "ttft_p50_first_turn_s": _round(pct(first, 50)),
        "ttft_p50_later_turns_s": _round(pct(later, 50)),
        "turns_per_min": round(completed / minutes, 2) if minutes else 0.0,
        "context_errors": kinds.count("context"),
        "other_errors": kinds.count("error") + kinds.count("out_of_cells"),
        "out_of_cells": kinds.count("out_of_cells"),
        "refused": kinds.count("refused"),
        "cache_hit_ratio": round(sum(r.cached_tokens for r in ok) / prompt, 4) if prompt else None,
        "turns_measured": len(recs),
        "turns_completed": completed,
        "turns_failed": sum(1 for r in recs if not r.ok and not r.cut),
        "turns_cut": sum(1 for r in recs if r.cut),
        "turns_cut_waiting": sum(1 for r in recs if r.waiting),
        "sessions_started": sum(w.sessions_started for w in windows),
        "prompt_tokens_answered": prompt,
        "measured_minutes": round(minutes, 2),
        "error_sample": sorted({d[:160] for r in recs for d in r.details})[:6],
    }


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


# --- bounds and targets ---------------------------------------------------------------------------------


def bounds(shapes: Shapes, lanes: list[list[Session]], c: Conditions, runs: list[dict[str, Any]]
           ) -> dict[str, Any]:
    """The floors of the turns macpool completed (each alone on an idle M2 Ultra holding its history): the
    least TTFT p50 and p99 any router can give those turns; and the most turns a minute: every lane at that
    pace, or about what the pool's Macs can step over the sessions a lane begins at that pace
    (``capacity``), whichever is less."""
    floor = Floors(shapes, load_preset(FASTEST.preset))
    sessions = {s.index: s for lane in lanes for s in lane}
    mine = [r for run in runs if run["router"] == "macpool" for r in run["_window"].measured if r.ok]
    ttfts = [floor.of(sessions[r.session])[r.turn].ttft_s for r in mine]
    paced = round(_ideal_turns(lanes, floor, c) / ((c.duration_s - c.warmup_s) / 60), 2)
    pool = capacity(shapes, [_reached(lane, floor, c, i, len(lanes)) for i, lane in enumerate(lanes)])
    return {
        "machine": FASTEST.name,
        "ttft_p50_s": _round(pct(ttfts, 50)),
        "ttft_p99_s": _round(pct(ttfts, 99)),
        "turns_per_min": min(paced, pool["turns_per_min"]),
        "turns_per_min_paced": paced,
        "capacity": pool,
    }


def _reached(sessions: list[Session], floor: Floors, c: Conditions, index: int, lanes: int) -> list[Session]:
    """The sessions of a lane that begin within the run at the pace of ``floor`` (every router's lane
    begins no more of them)."""
    t, out = c.workload.stagger_s * index / max(1, lanes), []
    for session in sessions:
        if t >= c.duration_s:
            break
        out.append(session)
        for n, turn in enumerate(session.turns):
            t += (turn.think_s if n else 0.0) + floor.of(session)[n].turn_s
        t += session.turns[0].think_s
    return out


def capacity(shapes: Shapes, lanes: list[list[Session]]) -> dict[str, Any]:
    """About the most turns a minute the pool's Macs can complete, whatever the router: each Mac stepping all
    the time, each turn of ``lanes`` at the least it costs that Mac on average (``Floor.work_s``: its history
    cached, and no step's pass over the weights counted, as if a batch shared it all). An average, not a
    strict bound: a window of a run holds some turns and not others. A Mac that holds every turn completes 60
    over its mean least work a turn. A Mac too small for a whole session (the M2 Pro's 32K) can only start
    sessions, which then move to a Mac that holds them and process their history there again: it adds the
    turns the M2 Ultra's seconds it saves would make, at the best rate one client's sessions give on average
    (M2 Ultra seconds saved, the move's cost taken off, over its own seconds spent; each session leaving
    after the turns that give it the best rate)."""
    sessions = [s for lane in lanes for s in lane]
    floors = {mac.name: Floors(shapes, load_preset(mac.preset), mac.context) for mac in MACS}
    whole = [mac.name for mac in MACS if all(len(floors[mac.name].of(s)) == len(s.turns) for s in sessions)]
    work = {name: statistics.fmean(f.work_s for s in sessions for f in floors[name].of(s)) for name in whole}
    turns = {name: 60 / work[name] for name in whole}
    ref = floors[FASTEST.name]
    for mac in MACS:
        if mac.name in turns:
            continue
        best = 0.0
        for client in {s.client for s in sessions}:
            rates = [_start_rate(floors[mac.name], ref, s) for s in sessions if s.client == client]
            best = max(best, statistics.fmean(rates))
        turns[mac.name] = 60 * best / work[FASTEST.name]
    return {"turns_per_min": round(sum(turns.values()), 2),
            "turns_per_min_by_mac": {name: round(v, 2) for name, v in turns.items()},
            "work_s_per_turn": {name: round(w, 2) for name, w in work.items()}}


def _start_rate(small: Floors, ref: Floors, session: Session) -> float:
    """The most reference-Mac seconds ``session`` saves a second of the small Mac's, serving its first turns
    there and moving on (0: none)."""
    mine, theirs = small.of(session), ref.of(session)
    saved = spent = best = 0.0
    for k, floor in enumerate(mine):
        saved, spent = saved + theirs[k].work_s, spent + floor.work_s
        after = k + 1
        move = ref.moved(session, after).work_s - theirs[after].work_s if after < len(theirs) else 0.0
        best = max(best, (saved - move) / spent)
    return best


def _ideal_turns(lanes: list[list[Session]], floor: Floors, c: Conditions) -> int:
    """Turns every lane completes in the run if each ran alone on the fastest Mac, its history cached."""
    done = 0
    for index, sessions in enumerate(lanes):
        t = c.workload.stagger_s * index / max(1, len(lanes))
        for session in sessions:
            for n, turn in enumerate(session.turns):
                t += turn.think_s if n else 0.0
                if t >= c.duration_s:
                    break
                t += floor.of(session)[n].turn_s
                done += c.warmup_s <= t <= c.duration_s
            t += session.turns[0].think_s
            if t >= c.duration_s:
                break
    return done


def targets(routers: dict[str, dict[str, Any]], bound: dict[str, Any] | None) -> dict[str, Any]:
    """macpool against the best peer on each figure: the ratio, the target, whether it is met, and the best
    ratio the bounds leave possible."""
    me = routers.get("macpool")
    peers = {name: r for name, r in routers.items() if name != "macpool"}
    out: dict[str, Any] = {"context_errors": {"target": 0, "macpool": me["context_errors"] if me else None,
                                              "met": bool(me and me["context_errors"] == 0)}}
    for key, target in TARGETS.items():
        values = {name: r[key] for name, r in peers.items() if r.get(key) is not None}
        if not me or me.get(key) is None or not values:
            continue
        lower_is_better = key != "turns_per_min"
        best = (min if lower_is_better else max)(values, key=lambda n: values[n])
        better, worse = (values[best], me[key]) if lower_is_better else (me[key], values[best])
        ratio = _ratio(better, worse)
        entry = {"target": target, "best_peer": best, "peer": values[best], "macpool": me[key],
                 "ratio": ratio, "met": better > 0 if ratio is None else ratio >= target}
        if bound and bound.get(key):
            entry["possible"] = (_ratio(values[best], bound[key]) if lower_is_better
                                 else _ratio(bound[key], values[best]))
        out[key] = entry
    return out


def _ratio(a: float, b: float) -> float | None:
    """``a / b``, or None where ``b`` is 0 (a peer that completed nothing: any figure beats it)."""
    return round(a / b, 2) if b else None


# --- the whole bench ------------------------------------------------------------------------------------


def run(c: Conditions, logs: Path, say: Say, install: bool = True) -> dict[str, Any]:
    nginx_bin = ensure_nginx(install) if {"nginx-least-conn", "nginx-sticky"} & set(c.routers) else None
    litellm_bin = ensure_litellm(install) if "litellm" in c.routers else None
    shapes = Shapes(MODEL)
    lanes = plan(c.workload, c.sessions_per_lane)
    with Stack(logs=logs, keep_logs=True) as stack:
        sims = start_sims(stack, c.speed)
        urls = [sim.url for sim in sims]
        macs = ", ".join(f"{m.name} ({m.slots} slots, {m.context} tokens a request, --cache-ram "
                         f"{m.cache_ram_mib})" for m in MACS)
        say(f"pool: {macs}; speed {c.speed:g}")
        targets_by_name: dict[str, str] = {}
        macpool = start_macpool(stack, sims, c.speed)
        agents = [p.url for p in stack.procs if p.name.startswith("agent-")]
        if "macpool" in c.routers:
            targets_by_name["macpool"] = macpool.url
        if nginx_bin:
            nginx = start_nginx(stack, nginx_bin, sims)
            targets_by_name |= {name: url for name, url in nginx.items() if name in c.routers}
        if litellm_bin:
            for strategy in c.litellm:
                name = "litellm" if len(c.litellm) == 1 else f"litellm {strategy}"
                say(f"starting LiteLLM ({strategy}) ...")
                targets_by_name[name] = start_litellm(stack, litellm_bin, sims, strategy).url
        warm_up(agents, macpool.url, say)
        names = router_names(c)
        runs: list[dict[str, Any]] = []
        for round_ in range(c.rounds):
            order = names if round_ % 2 == 0 else list(reversed(names))
            for name in order:
                say(f"round {round_ + 1}: {name} ...")
                result = measure(name, targets_by_name[name], urls, lanes, shapes, c, len(runs), say)
                runs.append(result | {"router": name, "round": round_ + 1})
        until_idle(urls, say)
    say("bounds: each turn alone on an idle M2 Ultra, and the least each costs each Mac ...")
    bound = bounds(shapes, lanes, c, runs) if "macpool" in c.routers else None
    routers = {name: pooled([r for r in runs if r["router"] == name]) for name in names}
    return {
        "bench": "agents",
        "macs": [asdict(mac) for mac in MACS],
        "routers": routers,
        "targets": targets(routers, bound),
        "bounds": bound,
        "conditions": asdict(c) | {"model": MODEL, "n_predict": N_PREDICT,
                                   "router_flags": list(router_flags(c.speed)),
                                   "sessions_per_lane": c.sessions_per_lane},
        "versions": {"litellm": litellm_version() if litellm_bin else None,
                     "nginx": _nginx_version(nginx_bin)},
        "runs": [{k: v for k, v in r.items() if k != "_window"} for r in runs],
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A router's figures over all its runs, each run's own beside them."""
    out = summarise([r["_window"] for r in runs])
    out["completed_by_mac"] = {mac.name: sum(r["completed_by_mac"][mac.name] for r in runs) for mac in MACS}
    out["prompt_tokens_processed"] = sum(r["prompt_tokens_processed"] for r in runs)
    out["busy_by_mac"] = {mac.name: _mean([r["busy_by_mac"][mac.name] for r in runs]) for mac in MACS}
    out["speed_achieved"] = [r["speed_achieved"] for r in runs]
    return out | {"by_run": [_brief(r) for r in runs]}


def _mean(values: list[float | None]) -> float | None:
    """The mean of the values measured (None: none was)."""
    known = [v for v in values if v is not None]
    return round(statistics.mean(known), 3) if known else None


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("run", "ttft_p50_s", "ttft_p99_s", "turns_per_min", "context_errors", "other_errors",
            "cache_hit_ratio", "speed_achieved")
    return {k: r.get(k) for k in keys}


def _nginx_version(binary: str | None) -> str | None:
    if binary is None:
        return None
    done = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    return done.stderr.strip() or None


# --- the report -----------------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> Table:
    t = Table(title="coding-agent sessions on a mixed pool (simulated seconds)")
    for column in ("router", "TTFT p50 s", "TTFT p99 s", "turns/min", "turns done", "context errors",
                   "other errors (out of cells)", "refused", "cache hit", "sessions",
                   "done m2pro/m4max/m2ultra", "busy m2pro/m4max/m2ultra"):
        t.add_column(column)
    for name, r in result["routers"].items():
        t.add_row(name, _num(r["ttft_p50_s"]), _num(r["ttft_p99_s"]), _num(r["turns_per_min"]),
                  str(r["turns_completed"]), str(r["context_errors"]),
                  f"{r['other_errors']} ({r['out_of_cells']})", str(r["refused"]),
                  _num(r["cache_hit_ratio"], 3), str(r["sessions_started"]),
                  "/".join(str(v) for v in r["completed_by_mac"].values()),
                  "/".join(_num(v) for v in r["busy_by_mac"].values()))
    return t


def verdicts(result: dict[str, Any]) -> list[str]:
    lines = []
    for key, entry in result["targets"].items():
        if key == "context_errors":
            lines.append(f"macpool context errors: {entry['macpool']} (target 0): "
                         f"{'met' if entry['met'] else 'MISSED'}")
            continue
        possible = f"; the bound allows {entry['possible']}x" if "possible" in entry else ""
        lines.append(f"{key}: macpool {entry['macpool']} vs best peer {entry['best_peer']} {entry['peer']}: "
                     f"{entry['ratio']}x (target {entry['target']}x): {'met' if entry['met'] else 'MISSED'}"
                     f"{possible}")
    pool = (result.get("bounds") or {}).get("capacity")
    if pool:
        macs = ", ".join(f"{name} {v}" for name, v in pool["turns_per_min_by_mac"].items())
        work = ", ".join(f"{name} {v} s" for name, v in pool["work_s_per_turn"].items())
        lines.append(f"the Macs can step about {pool['turns_per_min']} turns a minute ({macs}; "
                     f"mean least work a turn: {work})")
    return lines


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parser() -> argparse.ArgumentParser:
    d, w = Conditions(), Workload()
    p = argparse.ArgumentParser(prog="macpool bench agents", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=w.lanes, help="coding agents at work at once")
    p.add_argument("--duration", type=float, default=d.duration_s, help="simulated seconds of each run")
    p.add_argument("--warmup", type=float, default=d.warmup_s,
                   help="simulated seconds at the start of each run not measured (the lanes' first sessions)")
    p.add_argument("--speed", type=float, default=d.speed, help="simulator speed-up")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="runs of every router, the order reversed every other round")
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--turns", default=f"{w.turns[0]}-{w.turns[1]}", help="turns a session, a range")
    p.add_argument("--think", default=f"{w.think_s[0]:g}-{w.think_s[1]:g}",
                   help="simulated seconds of tool time between turns, a range")
    p.add_argument("--stagger", type=float, default=w.stagger_s, help="the lanes start spread over this long")
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"any of {', '.join(ROUTERS)}")
    p.add_argument("--litellm-strategy", default=",".join(d.litellm),
                   help=f"LiteLLM's routing strategy, or several to compare: {', '.join(LITELLM_STRATEGIES)}")
    p.add_argument("--skip-install", action="store_true", help="fail instead of installing a missing peer")
    p.add_argument("--json", type=Path, help="write the JSON result here")
    return p


def _range(text: str, kind: type[int] | type[float]) -> tuple[Any, Any]:
    low, _, high = text.partition("-")
    return kind(low), kind(high or low)


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    routers = tuple(name for name in args.routers.split(",") if name)
    unknown = set(routers) - set(ROUTERS)
    if unknown:
        p.error(f"unknown routers {sorted(unknown)}: pick from {', '.join(ROUTERS)}")
    strategies = tuple(s for s in args.litellm_strategy.split(",") if s)
    if set(strategies) - set(LITELLM_STRATEGIES):
        p.error(f"unknown LiteLLM strategies: pick from {', '.join(LITELLM_STRATEGIES)}")
    workload = replace(Workload(), lanes=args.sessions, seed=args.seed, turns=_range(args.turns, int),
                       think_s=_range(args.think, float), stagger_s=args.stagger)
    if not 0 <= args.warmup < args.duration:
        p.error("--warmup must be at least 0 and less than --duration")
    c = Conditions(workload=workload, duration_s=args.duration, warmup_s=args.warmup, speed=args.speed,
                   rounds=args.rounds, routers=routers, litellm=strategies)
    console = Console(stderr=True, width=200)
    logs = Path(tempfile.mkdtemp(prefix="macpool-bench-agents-"))
    try:
        result = run(c, logs, lambda line: console.print(line, markup=False), install=not args.skip_install)
    except PeerError as exc:
        print(f"macpool bench agents: {exc}", file=sys.stderr)
        return 1
    console.print(table(result))
    for line in verdicts(result):
        console.print(line, markup=False)
    console.print(f"logs: {logs}")
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0
