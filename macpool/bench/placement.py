"""``macpool bench placement``: a mixed pool of Macs behind macpool, LiteLLM and nginx, in the same run.

Three simulated Macs of different speed and capacity (``MACS``: an M5 Max, an M2 Pro and an M4 Max preset, one
model name), each behind its agent capped at its slots. In front of the same three simulators, in turn:

- macpool: Redis, the agents and a router (``--placement fastest``, the default);
- the LiteLLM proxy, ``routing_strategy: least-busy``, ``max_parallel_requests`` = each Mac's cap;
- nginx, ``least_conn``, ``max_conns`` = each Mac's cap.

First each Mac alone at its cap (the knees, measured together on their own simulators); then, at each load
level (closed-loop streaming clients, ``--levels`` times the pool's capacity), each router for
``--duration`` simulated seconds (below 1x ``--light-duration``, three times as long by default: with fewer
clients than slots, goodput rests on which Mac a handful of long answers land on, so a short run's figure
swings more than the target's margin); at the lowest level macpool also with ``--placement least-utilised``
(a second router on the same pool). Answers vary in length (``--spread``). macpool's routers queue a request
until a slot frees (``--queue-size 128 --queue-timeout 30``); a client answered 429, 502 or 503 tries again
50 ms later, and the answer it gets is timed from its first try.

Below 1x the pool cannot reach its knees: each Mac generates more tokens per second in a fuller batch, and
there are fewer clients than slots. So the bench also measures each Mac alone at every concurrency below its
cap, up to the most clients a level has (the curves, all three Macs at once, each on its own simulator), and
works out the best split: the most tokens per second the Macs generate between them with no more requests in
flight than there are clients. Whatever a router does, a load of that many clients is a succession of such
splits, so no placement can go past it (but for the runs' noise). From 1x on the best split is every Mac at
its best concurrency (its cap, unless noise says otherwise).

Per run: goodput (tokens the simulators generated per simulated second, steady part of the run), its ratio to
the sum of the knees and to the best split, TTFT and latency p50/p99 (simulated seconds), completed requests,
the clients never answered, 503s and other errors. Writes JSON (``--json``): ``knees`` (per Mac, tok/s),
``knee_sum_tok_s``, ``curves`` (per Mac: tok/s by concurrency, the cap's being the knee),
``ttft_p50_alone_s`` (per Mac, one client), ``levels`` (one per level: ``level``, ``clients``,
``best_tok_s``, ``best_split`` (clients per Mac), ``runs`` by router), and ``target``: macpool's goodput
against the best split at each level (``best_ratio``), the target (0.98 at every level) and ``met``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from macpool.bench.overload import Conditions, Run, drive
from macpool.bench.peers import PeerError, ensure_litellm, ensure_nginx
from macpool.dev.procs import ProcessError
from macpool.dev.redis_server import free_port
from macpool.dev.stack import Proc, Stack

MODEL = "sim"  # the one model name every simulator serves (--alias)
PAUSE_ON = (429, 502, 503)  # answers after which a client waits a little before its next request
ROUTER_FLAGS = ("--queue-size", "128", "--queue-timeout", "30")
BEST_SPLIT_TARGET = 0.98  # macpool's goodput against the best split, at every level (issue 40)


@dataclass(frozen=True)
class Mac:
    name: str
    preset: str
    cap: int


# one fast Mac and two slower ones holding most of the capacity (a new Mac joining older ones): where
# placement matters, since spreading by utilisation sends most requests to the slow ones
MACS = (
    Mac("m5max", "m5max-128g-14b-q4", 4),  # fast: ~92 tok/s per slot alone, prefill 3,000 tok/s
    Mac("m2pro", "m2pro-32g-8b-q4", 8),  # ~35 tok/s alone, prefill 650 tok/s
    Mac("m4max", "m4max-64g-32b-q4", 6),  # ~21 tok/s alone (a 32B model), prefill 300 tok/s
)
CAPACITY = sum(mac.cap for mac in MACS)


def start_sims(stack: Stack, speed: float) -> list[Proc]:
    return [
        stack.sim(f"sim-{mac.name}", "--preset", mac.preset, "--parallel", str(mac.cap), "--alias", MODEL,
                  "--speed", str(speed))
        for mac in MACS
    ]


def start_macpool(stack: Stack, sims: list[Proc]) -> tuple[str, Proc, Proc]:
    """Redis, an agent per Mac, and two routers: fastest placement and least-utilised."""
    redis_url = stack.redis()
    for mac, sim in zip(MACS, sims, strict=True):
        stack.agent(f"agent-{mac.name}", sim.url, redis_url, mac.name, "--cap", str(mac.cap))
    fastest = stack.router("router-fastest", redis_url, *ROUTER_FLAGS)
    least = stack.router("router-least-utilised", redis_url, *ROUTER_FLAGS, "--placement", "least-utilised")
    stack.wait_nodes(fastest.url, len(MACS), timeout=60, exact=True)
    stack.wait_nodes(least.url, len(MACS), timeout=60, exact=True)
    return redis_url, fastest, least


def start_nginx(stack: Stack, binary: str, sims: list[Proc]) -> Proc:
    folder = stack.logs / "nginx"
    folder.mkdir(exist_ok=True)
    port = free_port()
    servers = "".join(
        f"    server {sim.url.removeprefix('http://')} max_conns={mac.cap};\n"
        for mac, sim in zip(MACS, sims, strict=True)
    )
    temp = "".join(f"  {name}_temp_path {folder}/{name};\n"
                   for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = (
        f"worker_processes 1;\ndaemon off;\npid {folder}/nginx.pid;\nerror_log {folder}/error.log warn;\n"
        "events { worker_connections 4096; }\n"
        "http {\n  access_log off;\n" + temp
        + "  upstream macs {\n    least_conn;\n" + servers + "  }\n"
        f"  server {{\n    listen 127.0.0.1:{port};\n"
        '    location / { proxy_pass http://macs; proxy_http_version 1.1; proxy_set_header Connection "";'
        " proxy_buffering off; proxy_request_buffering off; proxy_read_timeout 600s; }\n  }\n}\n"
    )
    path = folder / "nginx.conf"
    path.write_text(conf)
    try:
        return stack.spawn("nginx", [binary, "-c", str(path), "-p", str(folder)], port, ready=None)
    except ProcessError as exc:
        raise PeerError(f"nginx did not start: {str(exc).splitlines()[0]}") from None


def start_litellm(stack: Stack, binary: Path, sims: list[Proc]) -> Proc:
    lines = ["model_list:"]
    for mac, sim in zip(MACS, sims, strict=True):
        lines += [
            f"  - model_name: {MODEL}",
            "    litellm_params:",
            f"      model: openai/{MODEL}",
            f"      api_base: {sim.url}/v1",
            "      api_key: none",
            f"      max_parallel_requests: {mac.cap}",
        ]
    lines += ["router_settings:", "  routing_strategy: least-busy",
              "litellm_settings:", "  telemetry: false"]
    config = stack.logs / "litellm.yaml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    argv = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", "1"]
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR",
           "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    try:
        return stack.spawn("litellm", argv, port, ready="/health/liveliness", timeout=180, env=env)
    except ProcessError as exc:
        raise PeerError(f"the LiteLLM proxy did not start: {str(exc).splitlines()[0]}") from None


def wait_port(proc: Proc, timeout: float = 30.0) -> None:
    """nginx has no health path: until it accepts a request (any answer)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(proc.url + "/health", timeout=2)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise PeerError(f"nginx is not answering on {proc.url}") from None
            time.sleep(0.2)


def measured(router_url: str, timeout: float = 60.0) -> None:
    """Until the router sees every Mac's slot speed (a warm-up answer on each)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = httpx.get(router_url + "/api/pool", timeout=5).json()["nodes"]
        if len(nodes) == len(MACS) and all(node.get("slot_tokens_per_s") for node in nodes):
            return
        time.sleep(0.5)
    raise RuntimeError("the Macs' slot speeds did not reach the router (no warm-up answer measured?)")


def alone(label: str, c: Conditions, loads: list[tuple[Mac, Proc, int]]) -> list[Run]:
    """Each Mac alone at its number of clients, all at once, each on its own simulator."""

    async def go() -> list[Run]:
        return list(await asyncio.gather(*(
            drive(f"{label} {mac.name} at {k}", [sim.url], [sim.url], c, k, MODEL, PAUSE_ON)
            for mac, sim, k in loads
        )))

    return asyncio.run(go())


def knees(c: Conditions, sims: list[Proc]) -> dict[str, float]:
    """Each Mac alone at its cap, twice as long as a run: the slowest Mac's answers take a good part of
    one."""
    longer = replace(c, duration_s=2 * c.duration_s)
    runs = alone("knee", longer, [(mac, sim, mac.cap) for mac, sim in zip(MACS, sims, strict=True)])
    return {mac.name: run.throughput_tok_s for mac, run in zip(MACS, runs, strict=True)}


def curves(c: Conditions, sims: list[Proc], below: int) -> dict[str, dict[int, Run]]:
    """Each Mac alone at 1 .. ``below`` - 1 clients, never at or past its cap (the knees are that); the
    runs by Mac and concurrency."""
    out: dict[str, dict[int, Run]] = {mac.name: {} for mac in MACS}
    for k in range(1, below):
        loads = [(mac, sim, k) for mac, sim in zip(MACS, sims, strict=True) if k < mac.cap]
        for (mac, _, _), result in zip(loads, alone("curve", c, loads), strict=True):
            out[mac.name][k] = result
    return out


def best_split(curves: dict[str, dict[int, float]], clients: int) -> tuple[float, dict[str, int]]:
    """The most tok/s the Macs generate between them with at most ``clients`` requests in flight, each Mac at
    a concurrency it was measured at (or idle), and how many requests each Mac holds for it."""
    names = list(curves)
    options = [[(0, 0.0), *sorted(curves[name].items())] for name in names]
    fits = (combo for combo in itertools.product(*options) if sum(k for k, _ in combo) <= clients)
    best = max(fits, key=lambda combo: sum(tok_s for _, tok_s in combo))
    split = {name: k for name, (k, _) in zip(names, best, strict=True)}
    return round(sum(tok_s for _, tok_s in best), 1), split


def per_mac(urls: list[str]) -> dict[str, dict[str, int]]:
    """The requests each Mac completed in the run just ended."""
    stats = [httpx.get(url + "/sim/stats", timeout=10).json() for url in urls]
    return {"completed_by_mac": {mac.name: int(s["completed"]) for mac, s in zip(MACS, stats, strict=True)}}


def run(
    c: Conditions, levels: list[float], logs: Path, console: Console, install: bool = True,
    light_duration_s: float | None = None,
) -> dict[str, Any]:
    nginx_bin, litellm_bin = ensure_nginx(install), ensure_litellm(install)
    light_s = light_duration_s or 3 * c.duration_s
    sims_all = [mac.name for mac in MACS]
    with Stack(logs=logs, keep_logs=True) as stack:
        sims = start_sims(stack, c.speed)
        urls = [sim.url for sim in sims]
        console.print(f"pool: {', '.join(f'{m.name} (cap {m.cap})' for m in MACS)}; capacity {CAPACITY}")
        console.print("knees: each Mac alone at its cap ...")
        knee = knees(c, sims)
        knee_sum = round(sum(knee.values()), 1)
        console.print(f"knees {knee} tok/s, sum {knee_sum}")
        # up to as many requests as the most clients a level has, the caps being measured already
        below = min(max(mac.cap for mac in MACS), max(round(level * CAPACITY) for level in levels) + 1)
        if below > 1:
            console.print(f"curves: each Mac alone at 1-{below - 1} clients ...")
        points = curves(c, sims, below)
        curve = {mac.name: {k: r.throughput_tok_s for k, r in points[mac.name].items()}
                 | {mac.cap: knee[mac.name]} for mac in MACS}
        # each Mac's first token with one client alone: the fastest Mac's is the least TTFT any placement gets
        alone = {mac.name: points[mac.name][1].ttft_p50_s for mac in MACS if 1 in points[mac.name]}
        console.print(f"curves {curve} tok/s")
        _, fastest, least = start_macpool(stack, sims)
        nginx = start_nginx(stack, nginx_bin, sims)
        wait_port(nginx)
        litellm = start_litellm(stack, litellm_bin, sims)
        console.print("warm-up: one answer on every Mac through macpool, then LiteLLM ...")
        warm = Conditions(prompt_tokens=c.prompt_tokens, max_tokens=32, duration_s=4 * c.speed, speed=c.speed)
        asyncio.run(drive("warm-up", [least.url], urls, warm, CAPACITY, MODEL, PAUSE_ON))
        asyncio.run(drive("warm-up", [litellm.url], urls, warm, 2, MODEL, PAUSE_ON))
        measured(fastest.url)
        routers = {"macpool": fastest.url, "litellm": litellm.url, "nginx": nginx.url}
        out_levels = []
        for level in levels:
            clients = max(1, round(level * CAPACITY))
            best, split = best_split(curve, clients)
            console.print(f"{level:g}x ({clients} clients): the best split {split} makes {best} tok/s")
            runs: dict[str, dict[str, Any]] = {}
            at = c if level >= 1 else replace(c, duration_s=light_s)
            order = dict(routers)
            if level == min(levels):
                order["macpool least-utilised"] = least.url
            for name, url in order.items():
                console.print(f"{level:g}x ({clients} clients): {name} ...")
                result = asyncio.run(drive(f"{name} {level:g}x", [url], urls, at, clients, MODEL, PAUSE_ON))
                runs[name] = asdict(result) | {
                    "goodput_ratio": round(result.throughput_tok_s / knee_sum, 3) if knee_sum else None,
                    "best_ratio": round(result.throughput_tok_s / best, 3) if best else None,
                    **per_mac(urls),
                }
            out_levels.append({"level": level, "clients": clients, "duration_s": at.duration_s,
                               "best_tok_s": best, "best_split": split, "runs": runs})
    return {
        "target": check(out_levels),
        "macs": [asdict(mac) for mac in MACS],
        "capacity": CAPACITY,
        "knees": knee,
        "knee_sum_tok_s": knee_sum,
        "curves": {name: {str(k): tok_s for k, tok_s in sorted(points.items())}
                   for name, points in curve.items()},
        "ttft_p50_alone_s": alone,
        "levels": out_levels,
        "conditions": asdict(c) | {"light_duration_s": light_s, "levels": levels,
                                    "router_flags": list(ROUTER_FLAGS), "macs": sims_all},
    }


def check(levels: list[dict[str, Any]], target: float = BEST_SPLIT_TARGET) -> dict[str, Any]:
    """macpool's goodput against the best split at each level (``best_ratio``), and whether every level
    reaches ``target``; a level macpool did not run fails it."""
    ratios = {f"{level['level']:g}": (level["runs"].get("macpool") or {}).get("best_ratio")
              for level in levels}
    met = {name: ratio is not None and ratio >= target for name, ratio in ratios.items()}
    return {"target": target, "best_ratio": ratios, "met_by_level": met,
            "met": bool(met) and all(met.values())}


def verdict(result: dict[str, Any]) -> str:
    t = result["target"]
    worst = min((r for r in t["best_ratio"].values() if r is not None), default=None)
    return (f"macpool goodput / best split, by level: {t['best_ratio']} (target {t['target']} at every "
            f"level; worst {worst}): {'met' if t['met'] else 'NOT MET'}")


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"mixed pool, sum of knees {result['knee_sum_tok_s']} tok/s (simulated seconds)")
    names = "/".join(mac.name for mac in MACS)
    for column in ("load (best split tok/s)", "router", "goodput tok/s", "/ knees", "/ best",
                   "TTFT p50 / p99 s", "latency p50 / p99 s", f"completed ({names})", "clients unanswered",
                   "503", "other errors"):
        t.add_column(column)
    for level in result["levels"]:
        for name, r in level["runs"].items():
            t.add_row(
                f"{level['level']:g}x ({level['clients']}; {level['best_tok_s']:.0f})", name,
                f"{r['throughput_tok_s']:.0f}", f"{r['goodput_ratio']:.3f}", f"{r['best_ratio']:.3f}",
                _pair(r["ttft_p50_s"], r["ttft_p99_s"]),
                _pair(r["latency_p50_s"], r["latency_p99_s"]),
                f"{r['completed']} ({'/'.join(str(n) for n in r['completed_by_mac'].values())})",
                str(r["unserved_clients"]), str(r["rejected_503"]),
                str(r["errors_non_503"]),
            )
    return t


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a:.2f} / {b:.2f}"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="macpool bench placement", description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="0.5,1,2,4", help="load levels, times the pool's capacity")
    p.add_argument("--duration", type=float, default=80.0, help="simulated seconds of load per run")
    p.add_argument("--light-duration", type=float,
                   help="simulated seconds of load per run below 1x (default: three times --duration)")
    p.add_argument("--speed", type=float, default=2.0, help="simulator speed-up")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128, help="mean answer length")
    p.add_argument("--spread", type=float, default=0.5,
                   help="answer lengths vary uniformly within max-tokens x (1 +/- spread); 0: all alike")
    p.add_argument("--skip-install", action="store_true", help="fail instead of installing a missing peer")
    p.add_argument("--json", type=Path, help="write the JSON result here (default: stdout)")
    args = p.parse_args(argv)
    levels = sorted(float(x) for x in args.levels.split(","))
    if args.light_duration is not None and not args.light_duration > 0:
        p.error("--light-duration must be above 0")
    if not 0 <= args.spread < 1:
        p.error("--spread must be at least 0 and below 1")
    c = Conditions(prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens, spread=args.spread,
                   from_first_try=True, duration_s=args.duration, speed=args.speed)
    console = Console(stderr=True)
    logs = Path(tempfile.mkdtemp(prefix="macpool-bench-placement-"))
    try:
        result = run(c, levels, logs, console, install=not args.skip_install,
                     light_duration_s=args.light_duration)
    except PeerError as exc:
        print(f"macpool bench placement: {exc}", file=sys.stderr)
        return 1
    console.print(table(result))
    console.print(verdict(result), markup=False)
    console.print(f"logs: {logs}")
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0
