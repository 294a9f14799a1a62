"""``macpool bench models``: a workload that shifts from model A to model B and back on Macs that hold one
model at a time, each model loaded on demand.

The pool: a Redis-protocol server, ``--macs`` simulated Macs and one router (``--cold-start-timeout``, load
on demand on). Each Mac is one agent running ``--models a=A.gguf,b=B.gguf`` over a router-mode simulator
(``m2pro-32g-8b-q4``, whose wired limit the agent is given too); the model files are sparse GGUFs sized so
that one model (weights plus every slot's KV cache) fits the wired limit minus the headroom and two do not.
So a Mac serves one model at a time: every model node starts in standby, a request for a model loaded
nowhere waits while the router asks one Mac to load it, and ``--idle-unload`` gives a model's memory back
a few seconds after its last request.

Phases, ``--phase-seconds`` each: A, B, then A again. Closed-loop streaming clients ask for the phase's
model; a 503 waits its Retry-After (at most ``--retry-cap`` seconds) and is sent again. A request belongs
to the phase it was sent in. Reported per phase:

- the TTFT of its first ``FIRST_N`` completed requests (the cold start after the shift), the wait from the
  shift to the phase's first token, and the phase's TTFT p50;
- goodput (completed requests per second of the phase), 503s by reason, and errors other than a 503
  (anything else, a cut stream or an error event inside one: must be 0);
- per Mac, the peak pinned memory (the simulator's ``/sim/memory``, sampled every 0.2 s) and the loads each
  model began.

Over the run, per Mac: the peak pinned memory against its wired limit (must never be passed) and each
model's loads. Times are wall seconds. The first TTFTs count from each request's own sending; when 503s
came first, the wait from the shift to the first token is the figure that includes them.

The router asks for a model's load at most once per ``--cold-start-timeout`` (``{p}loading:{model}``), so
the phases are meant to be longer than half of it: a return to A sooner after A's previous load waits for
that ask to lapse before a Mac is asked again.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool.bench.report import run_and_report
from macpool.bench.sse import Events, delta_text
from macpool.bench.stack import Stack
from macpool.bench.stats import pct
from macpool.dev.procs import ProcessError, macpool_argv
from macpool.gguf_info import read_shape
from macpool.sim.machine import load_preset
from macpool.sim.model_files import write_model_gguf

AGENT_TOKEN = "models-agent-token"
PRESET = "m2pro-32g-8b-q4"
FIRST_N = 3  # the first requests after a shift whose TTFT is reported one by one
BIN_S = 0.5  # the timeline's resolution (requests/s, TTFT)
START_TIMEOUT_S = 60.0


@dataclass
class ModelsOptions:
    macs: int = 2
    models: tuple[str, ...] = ("a", "b")  # the phases: each in turn, then the first again
    weights_gb: float = 10.0  # each model file's size: 10 GB + 4 slots x 4,096 tokens of KV = 12.1 GB
    parallel: int = 4  # slots of each model
    ctx_per_slot: int = 4096
    headroom_gb: float = 2.0
    idle_unload: float = 5.0
    phase_s: float = 20.0
    clients: int = 4
    speed: float = 5.0
    max_tokens: int = 32
    cold_start_timeout: float = 30.0
    retry_cap: float = 2.0  # the longest a 503's Retry-After is honoured
    sample_s: float = 0.2
    plot: Path | None = None

    def phases(self) -> list[Phase]:
        names = [*self.models, self.models[0]]
        return [Phase(i, name, i * self.phase_s, (i + 1) * self.phase_s) for i, name in enumerate(names)]


@dataclass(frozen=True)
class Phase:
    index: int
    model: str
    start_s: float
    end_s: float


@dataclass
class Outcome:
    """One request: when it was sent and ended (seconds from the start of the workload), and how."""

    sent: float
    ended: float
    phase: int
    status: int  # 0: no HTTP answer
    reason: str = ""  # a 503's X-Macpool-Reason, or what went wrong
    ttft_s: float | None = None
    error: str = ""  # set for anything but a completed stream or a 503


@dataclass
class Mac:
    name: str
    agent_url: str
    sim_url: str
    wired_limit_gb: float


@dataclass
class Sample:
    t: float
    mac: str
    pinned_gb: float
    loads: dict[str, int] = field(default_factory=dict)  # model -> loads begun on this Mac so far


# --- the pool ---------------------------------------------------------------------------------------------

def write_models(folder: Path, opts: ModelsOptions) -> dict[str, Path]:
    """One sparse GGUF per model, of ``weights_gb`` and an 8B model's attention shape."""
    folder.mkdir(parents=True, exist_ok=True)
    return {name: write_model_gguf(folder / f"{name}.gguf", weights_gb=opts.weights_gb)
            for name in opts.models}


def model_memory_gb(path: Path, opts: ModelsOptions) -> float:
    """What an agent counts for one loaded model: weights and every slot's KV (node_agent/models.py)."""
    shape = read_shape(path)
    return shape.weights_gb + opts.parallel * opts.ctx_per_slot * shape.kv_bytes_per_token() / 1e9


def check_fit(memory_gb: float, wired_limit_gb: float, opts: ModelsOptions) -> None:
    """The workload is only the question it asks when a Mac holds one model and not two."""
    budget = wired_limit_gb - opts.headroom_gb
    if not memory_gb <= budget < 2 * memory_gb:
        raise SystemExit(
            f"macpool bench models: one model takes {memory_gb:.2f} GB and a Mac's budget is {budget:.2f} GB "
            f"({PRESET}'s wired limit {wired_limit_gb:g} - headroom {opts.headroom_gb:g}): choose "
            "--weights-gb so that one model fits and two do not"
        )


def start_pool(stack: Stack, opts: ModelsOptions, say: Callable[[str], None]) -> tuple[str, list[Mac]]:
    """Start the pool; returns its router's URL and the Macs, once every model node is in standby."""
    procs = stack.procs
    files = write_models(stack.logs / "models", opts)
    wired_limit = load_preset(PRESET).wired_limit_gb
    memory = model_memory_gb(next(iter(files.values())), opts)
    check_fit(memory, wired_limit, opts)
    say(f"pool: {opts.macs} Macs ({PRESET}, wired limit {wired_limit:g} GB, headroom {opts.headroom_gb:g}), "
        f"models {', '.join(opts.models)} of {memory:.2f} GB each ({opts.parallel} slots)")
    redis_url = procs.redis()
    sim = shlex.join(macpool_argv("sim", "--preset", PRESET, "--speed", str(opts.speed)))
    models = ",".join(f"{name}={path}" for name, path in files.items())
    agents = []
    for i in range(opts.macs):
        agents.append(procs.macpool(
            f"agent-{i}", "agent", "run", "--llama-server", sim, "--models", models,
            "--redis-url", redis_url, "--node-id", f"mac-{i}", "--token", AGENT_TOKEN,
            "--wired-limit-gb", str(wired_limit), "--headroom-gb", str(opts.headroom_gb),
            "--parallel", str(opts.parallel), "--ctx-per-slot", str(opts.ctx_per_slot),
            "--idle-unload", str(opts.idle_unload), "--heartbeat-interval", "0.25", "--log-level", "info",
        ))
    router = procs.router(
        "router", redis_url, "--agent-token", AGENT_TOKEN, "--refresh-interval", "0.25",
        "--cold-start-timeout", str(opts.cold_start_timeout), "--log-level", "info",
    )
    wait_standby(stack, router.url, opts.macs * len(opts.models))
    macs = [Mac(f"mac-{i}", agent.url, sim_url(agent.url), wired_limit) for i, agent in enumerate(agents)]
    return router.url, macs


def wait_standby(stack: Stack, router_url: str, count: int) -> None:
    """Until the router sees ``count`` model nodes, each in standby."""
    deadline = time.monotonic() + START_TIMEOUT_S
    states: list[str] = []
    while time.monotonic() < deadline:
        try:
            nodes = httpx.get(router_url + "/api/pool", timeout=5).json().get("nodes") or []
            states = [str(n.get("state")) for n in nodes]
        except (httpx.HTTPError, ValueError):
            states = []
        if len(states) == count and all(s == "standby" for s in states):
            return
        dead = stack.procs.dead()
        if dead:
            raise ProcessError(f"{dead[0].name} exited (log: {dead[0].log_path})")
        time.sleep(0.2)
    raise ProcessError(f"the router saw model nodes {states}, not {count} in standby (logs: {stack.logs})")


def sim_url(agent_url: str) -> str:
    """The simulator an agent runs (its ``/status``), whose ``/sim/memory`` is the Mac's memory."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            url = (httpx.get(agent_url + "/status", timeout=5).json().get("llama_server") or {}).get("url")
            if url and httpx.get(url + "/sim/memory", timeout=5).status_code == 200:
                return str(url)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise ProcessError(f"the agent at {agent_url} named no simulator that answers /sim/memory")


# --- the workload -----------------------------------------------------------------------------------------

async def stream_chat(http: httpx.AsyncClient, url: str, body: dict[str, Any], out: Outcome) -> float:
    """Send one streamed chat, read it to the end, fill ``out``; returns a 503's Retry-After (0 otherwise)."""
    started = time.monotonic()
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        out.status = response.status_code
        if response.status_code == 503:
            await response.aread()
            out.reason = response.headers.get("x-macpool-reason", "?")
            try:
                return float(response.headers.get("retry-after", "1"))
            except ValueError:
                return 1.0
        if response.status_code != 200:
            await response.aread()
            out.error = f"HTTP {response.status_code}: {response.text[:120]}"
            return 0.0
        events = Events(response)
        async for event in events:
            if "error" in event:
                out.error = f"error event: {(event['error'] or {}).get('code', '?')}"
                continue
            if out.ttft_s is None and delta_text(event):
                out.ttft_s = time.monotonic() - started
        if not out.error and (not events.done or out.ttft_s is None):
            out.error = "stream ended without [DONE]" if not events.done else "stream without content"
    return 0.0


async def drive(router_url: str, macs: list[Mac], opts: ModelsOptions) -> tuple[list[Outcome], list[Sample]]:
    """The phases, closed loop, with every Mac's memory sampled meanwhile."""
    plan = opts.phases()
    total = plan[-1].end_s
    outcomes: list[Outcome] = []
    samples: list[Sample] = []
    start = time.monotonic()

    def phase_at(t: float) -> Phase:
        return next((p for p in plan if t < p.end_s), plan[-1])

    async def client(http: httpx.AsyncClient) -> None:
        while (t := time.monotonic() - start) < total:
            phase = phase_at(t)
            body = {"model": phase.model, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": opts.max_tokens, "stream": True}
            out = Outcome(t, t, phase.index, 0)
            try:
                retry_after = await stream_chat(http, router_url, body, out)
            except (httpx.HTTPError, ValueError) as exc:
                retry_after, out.error = 0.0, f"{type(exc).__name__}: {exc}"[:160]
            out.ended = time.monotonic() - start
            outcomes.append(out)
            if out.status == 503:
                await asyncio.sleep(min(retry_after, opts.retry_cap))
            elif out.error:
                await asyncio.sleep(0.2)  # (a failure must not turn into a busy loop)

    async def sample(http: httpx.AsyncClient) -> None:
        while not clients_done.is_set():
            t = time.monotonic() - start
            for mac in macs:
                try:
                    doc = (await http.get(mac.sim_url + "/sim/memory")).json()
                except (httpx.HTTPError, ValueError):
                    continue
                mac.wired_limit_gb = float(doc.get("wired_limit_gb", mac.wired_limit_gb))
                loads = {name: int(m.get("loads", 0)) for name, m in (doc.get("models") or {}).items()}
                samples.append(Sample(round(t, 2), mac.name, float(doc.get("pinned_gb", 0.0)), loads))
            await asyncio.sleep(max(0.0, opts.sample_s - (time.monotonic() - start - t)))

    limits = httpx.Limits(max_connections=opts.clients + 8, max_keepalive_connections=opts.clients + 8)
    timeout = httpx.Timeout(opts.cold_start_timeout + 60, connect=10)
    clients_done = asyncio.Event()  # the sampling goes on until the last request has ended

    async def clients(http: httpx.AsyncClient) -> None:
        try:
            await asyncio.gather(*(client(http) for _ in range(opts.clients)))
        finally:
            clients_done.set()

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        await asyncio.gather(sample(http), clients(http))
    return outcomes, samples


# --- the figures ------------------------------------------------------------------------------------------

def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def loads_by(samples: list[Sample], mac: str, until: float) -> dict[str, int]:
    """Each model's loads begun on ``mac`` by ``until`` (the last sample at or before it)."""
    before = [s for s in samples if s.mac == mac and s.t <= until]
    return dict(before[-1].loads) if before else {}


def summarize_phase(phase: Phase, outcomes: list[Outcome], samples: list[Sample], macs: list[Mac],
                    end: float) -> dict[str, Any]:
    """One phase's figures; its memory samples run until ``end`` (the next phase's start, or the last
    sample: the last phase's requests in flight end after it)."""
    mine = sorted((o for o in outcomes if o.phase == phase.index), key=lambda o: o.sent)
    ok = [o for o in mine if o.status == 200 and not o.error]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    first_tokens = [o.sent + o.ttft_s for o in ok if o.ttft_s is not None]
    seconds = phase.end_s - phase.start_s
    per_mac: dict[str, dict[str, Any]] = {}
    for mac in macs:
        pinned = [s.pinned_gb for s in samples if s.mac == mac.name and phase.start_s <= s.t < end]
        before, after = loads_by(samples, mac.name, phase.start_s), loads_by(samples, mac.name, end)
        per_mac[mac.name] = {
            "peak_pinned_gb": max(pinned, default=None),
            "loads": {name: n - before.get(name, 0) for name, n in after.items()},
        }
    return {
        "model": phase.model,
        "start_s": phase.start_s,
        "end_s": phase.end_s,
        "requests": len(mine),
        "completed": len(ok),
        "goodput_rps": round(len(ok) / seconds, 2),
        "first_ttft_s": [_round(t) for t in ttfts[:FIRST_N]],
        "first_token_after_shift_s": _round(min(first_tokens) - phase.start_s) if first_tokens else None,
        "ttft_p50_s": _round(pct(ttfts, 50)),
        "ttft_p99_s": _round(pct(ttfts, 99)),
        "rejected": dict(Counter(o.reason for o in mine if o.status == 503)),
        "errors": len([o for o in mine if o.status != 503 and (o.error or o.status != 200)]),
        "error_kinds": dict(Counter(o.error.split(":")[0] for o in mine if o.error)),
        "macs": per_mac,
    }


def timeline(outcomes: list[Outcome], samples: list[Sample], total: float) -> dict[str, Any]:
    """Requests/s and TTFT (p50 and max of the requests sent) per ``BIN_S``, and the memory samples."""
    bins = []
    for i in range(int(total / BIN_S) + 1):
        lo, hi = i * BIN_S, (i + 1) * BIN_S
        done = [o for o in outcomes if lo <= o.ended < hi and o.status == 200 and not o.error]
        sent = [o.ttft_s for o in outcomes if lo <= o.sent < hi and o.ttft_s is not None and not o.error]
        bins.append({"t": lo, "completed_rps": len(done) / BIN_S, "ttft_p50_s": _round(pct(sent, 50)),
                     "ttft_max_s": _round(max(sent, default=None))})
    memory: dict[str, list[list[float]]] = {}
    for s in samples:
        memory.setdefault(s.mac, []).append([s.t, round(s.pinned_gb, 3)])
    return {"bin_s": BIN_S, "requests": bins, "pinned_gb": memory}


def summarize(opts: ModelsOptions, macs: list[Mac], outcomes: list[Outcome], samples: list[Sample]
              ) -> dict[str, Any]:
    plan = opts.phases()
    end = max([plan[-1].end_s, *(s.t for s in samples), *(o.ended for o in outcomes)]) + 0.01
    phases = [summarize_phase(p, outcomes, samples, macs, end if p is plan[-1] else p.end_s) for p in plan]
    per_mac: dict[str, dict[str, Any]] = {}
    for mac in macs:
        pinned = [s.pinned_gb for s in samples if s.mac == mac.name]
        per_mac[mac.name] = {
            "wired_limit_gb": mac.wired_limit_gb,
            "peak_pinned_gb": max(pinned, default=None),
            "samples": len(pinned),
            "loads": loads_by(samples, mac.name, end),
        }
    loads = Counter[str]()
    for figures in per_mac.values():
        loads.update(figures["loads"])
    return {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "preset": PRESET,
        "completed": sum(p["completed"] for p in phases),
        "errors": sum(p["errors"] for p in phases),
        "rejected": dict(sum((Counter(p["rejected"]) for p in phases), Counter[str]())),
        "loads": dict(loads),
        "within_wired_limit": all(
            m["peak_pinned_gb"] is not None and m["peak_pinned_gb"] <= m["wired_limit_gb"]
            for m in per_mac.values()
        ),
        "cold_start_shows": all(
            p["first_ttft_s"] and p["ttft_p50_s"] is not None and p["first_ttft_s"][0] > p["ttft_p50_s"]
            for p in phases
        ),
        "phases": phases,
        "macs": per_mac,
        "timeline": timeline(outcomes, samples, end),
    }


def run(opts: ModelsOptions, stack: Stack, say: Callable[[str], None]) -> dict[str, Any]:
    router_url, macs = start_pool(stack, opts, say)
    say(f"phases: {' -> '.join(p.model for p in opts.phases())}, {opts.phase_s:g} s each, "
        f"{opts.clients} clients")
    outcomes, samples = asyncio.run(drive(router_url, macs, opts))
    result = summarize(opts, macs, outcomes, samples)
    if opts.plot is not None:
        plot(result, opts.plot)
    return result


def table(result: dict[str, Any]) -> str:
    macs = list(result["macs"])
    rows = [
        f"{'phase':<7} {'first TTFTs s':<18} {'1st token':>9} {'p50 s':>6} {'req/s':>6} {'errors':>6} "
        + " ".join(f"{mac + ' peak GB':>14}" for mac in macs) + "  loads  503s by reason"
    ]
    for i, p in enumerate(result["phases"]):
        firsts = " ".join(f"{t:.2f}" for t in p["first_ttft_s"]) or "-"
        first = "-" if p["first_token_after_shift_s"] is None else f"{p['first_token_after_shift_s']:.2f}"
        p50 = "-" if p["ttft_p50_s"] is None else f"{p['ttft_p50_s']:.3f}"
        peaks = " ".join(f"{_gb(p['macs'][mac]['peak_pinned_gb']):>14}" for mac in macs)
        loads = ", ".join(f"{mac} {name}" for mac in macs for name, n in p["macs"][mac]["loads"].items()
                          for _ in range(n)) or "-"
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(p["rejected"].items())) or "-"
        rows.append(f"{i + 1}: {p['model']:<4} {firsts:<18} {first:>9} {p50:>6} {p['goodput_rps']:>6.2f} "
                    f"{p['errors']:>6} {peaks}  {loads}  {rejected}")
    for mac, m in result["macs"].items():
        loads = ", ".join(f"{name} {n}" for name, n in m["loads"].items())
        rows.append(f"{mac}: peak pinned {_gb(m['peak_pinned_gb'])} GB of a {m['wired_limit_gb']:g} GB wired "
                    f"limit; loads {loads}")
    rows.append(f"completed {result['completed']}, errors other than 503: {result['errors']}, "
                f"within wired limit: {result['within_wired_limit']}, cold start shows: "
                f"{result['cold_start_shows']}")
    return "\n".join(rows)


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(result: dict[str, Any], out: Path) -> None:
    from macpool import plotting

    plt = plotting.pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    line = result["timeline"]
    bins = line["requests"]
    ts = [b["t"] + line["bin_s"] / 2 for b in bins]
    top.plot(ts, [b["completed_rps"] for b in bins], color="C0", lw=1, label="completed requests/s")
    top.set_ylabel("requests/s")
    twin = top.twinx()
    for key, style, label in (("ttft_max_s", "C3.", "TTFT max"), ("ttft_p50_s", "C1.", "TTFT p50")):
        points = [(t, b[key]) for t, b in zip(ts, bins, strict=True) if b[key] is not None]
        twin.plot([t for t, _ in points], [v for _, v in points], style, ms=4, label=f"{label} (sent then)")
    twin.set_yscale("log")
    twin.set_ylabel("TTFT s (log)")
    for mac, name in enumerate(result["macs"]):
        points = line["pinned_gb"].get(name, [])
        bottom.plot([t for t, _ in points], [v for _, v in points], color=f"C{mac}", label=f"{name} pinned")
    headroom = result["options"]["headroom_gb"]
    for limit in sorted({m["wired_limit_gb"] for m in result["macs"].values()}):
        bottom.axhline(limit, color="C3", lw=1, label=f"wired limit {limit:g} GB")
        bottom.axhline(limit - headroom, color="C3", ls=":", lw=1, label=f"agent budget (- {headroom:g})")
    bottom.set_ylabel("pinned GB (/sim/memory)")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(bottom=0)
    for ax in (top, bottom):
        for p in result["phases"]:
            ax.axvline(p["start_s"], color="k", lw=0.8, ls="--")
    for p in result["phases"]:
        top.text(p["start_s"] + 0.3, 1.01, f"model {p['model']}", transform=top.get_xaxis_transform(),
                 fontsize=8)
    handles, labels = top.get_legend_handles_labels()
    more, more_labels = twin.get_legend_handles_labels()
    top.legend(handles + more, labels + more_labels, fontsize=7, loc="upper right")
    bottom.legend(fontsize=7, loc="lower right")
    top.set_title("bench models: shifts between models loaded on demand", pad=16)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    d = ModelsOptions()
    p = argparse.ArgumentParser(prog="macpool bench models", description=__doc__.split("\n\n")[0])
    p.add_argument("--macs", type=int, default=d.macs, help=f"simulated Macs ({d.macs})")
    p.add_argument("--models", default=",".join(d.models),
                   help="model names, comma-separated: a phase each, then the first again (a,b)")
    p.add_argument("--weights-gb", type=float, default=d.weights_gb,
                   help=f"each model file's size; one must fit a Mac and two not ({d.weights_gb:g})")
    p.add_argument("--parallel", type=int, default=d.parallel, help=f"slots of each model ({d.parallel})")
    p.add_argument("--phase-seconds", type=float, default=d.phase_s, help=f"each phase ({d.phase_s:g})")
    p.add_argument("--clients", type=int, default=d.clients, help=f"closed-loop clients ({d.clients})")
    p.add_argument("--speed", type=float, default=d.speed, help=f"simulator speed-up ({d.speed:g})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"per request ({d.max_tokens})")
    p.add_argument("--idle-unload", type=float, default=d.idle_unload,
                   help=f"the agents' --idle-unload, seconds ({d.idle_unload:g})")
    p.add_argument("--cold-start-timeout", type=float, default=d.cold_start_timeout,
                   help=f"the router's, seconds ({d.cold_start_timeout:g})")
    p.add_argument("--retry-cap", type=float, default=d.retry_cap,
                   help=f"longest wait on a 503's Retry-After, seconds ({d.retry_cap:g})")
    p.add_argument("--plot", type=Path, help="PNG of requests/s, TTFT and each Mac's pinned memory over time")
    p.add_argument("--json", type=Path, help="write the whole result here")
    p.add_argument("--logs", type=Path, help="keep every process's log in this folder")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    a = p.parse_args(argv)
    models = tuple(filter(None, (m.strip() for m in a.models.split(","))))
    if len(models) < 2 or len(set(models)) < len(models):
        p.error(f"--models {a.models!r}: give two or more different names")
    if a.macs < 1 or a.clients < 1 or a.parallel < 1 or a.phase_seconds <= 0:
        p.error("--macs, --clients, --parallel and --phase-seconds must be positive")
    if a.plot is not None:
        from macpool import plotting

        plotting.check()
    opts = ModelsOptions(
        macs=a.macs, models=models, weights_gb=a.weights_gb, parallel=a.parallel, phase_s=a.phase_seconds,
        clients=a.clients, speed=a.speed, max_tokens=a.max_tokens, idle_unload=a.idle_unload,
        cold_start_timeout=a.cold_start_timeout, retry_cap=a.retry_cap, plot=a.plot,
    )
    details = ("options", "phases", "macs", "timeline")
    return run_and_report(lambda stack, say: run(opts, stack, say), table, a.logs, a.json, details)
