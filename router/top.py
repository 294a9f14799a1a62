"""``macpool top``: a live terminal view of the pool (GET /api/pool), for operators on ssh."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from macpool.credentials import SecretError, read_secret

GONE_KEEP_S = 120.0  # as long as the dashboard keeps it (router/static/dashboard.js GONE_KEEP_MS)

STATE_STYLE = {
    "healthy": "green",
    "near ceiling": "yellow",
    "paging": "dark_orange",
    "draining": "blue",
    "unhealthy": "red",
    "starting": "magenta",
    "downloading": "cyan",
    "gone": "bright_black",
}

COLUMNS = ("node", "state", "models", "slots", "resv", "KV cells", "memory GB", "tok/s", "TTFT", "reason")
REASON_MIN_WIDTH = 120  # narrower terminals drop the reason column rather than squash the figures


def node_state(doc: dict[str, Any]) -> str:
    """The dashboard's state label for a node document from /api/pool."""
    memory = doc.get("memory") or {}
    if doc.get("drained") or doc.get("state") == "draining":
        return "draining"
    if doc.get("state") == "unhealthy" or doc.get("circuit") == "open":
        return "unhealthy"
    if doc.get("state") == "paging" or memory.get("state") in ("paging", "collapsed"):
        return "paging"
    if doc.get("state") in ("starting", "downloading"):
        return str(doc["state"])
    if memory.get("state") == "near_ceiling" or memory.get("pressure") in ("warning", "critical"):
        return "near ceiling"
    return "healthy"


def _bar(used: float, total: float, width: int = 10) -> str:
    if total <= 0:
        return " " * width
    filled = max(0, min(width, round(width * used / total)))
    return "█" * filled + "·" * (width - filled)


def _reason(doc: dict[str, Any]) -> str:
    reason = str(doc.get("reason") or "")
    if doc.get("drained"):  # the agent does not know: its own reason would hide why the node takes nothing
        return "drained through the admin API" + (f"; {reason}" if reason else "")
    return reason


def models_text(doc: dict[str, Any]) -> str:
    """Each model a node serves or could load, with its phase and the memory it holds: ``m loaded 12.3G``."""
    states = doc.get("model_states") or []
    if not states:
        return ", ".join(doc.get("models") or []) or "-"
    out = []
    for model in states:
        memory = model.get("memory_gb")
        held = "" if memory is None else f" {memory:.1f}G"
        download = model.get("download") or {}
        if model.get("state") == "downloading":  # how far, and of how much
            held = f" {download.get('percent', 0):.0f}% of {download.get('total_bytes', 0) / 1e9:.1f}G"
        out.append(f"{model.get('name')} {model.get('state')}{held}")
    return ", ".join(out)


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


@dataclass
class TopView:
    """Remembers nodes that left the pool so they show as gone for a while."""

    gone: dict[str, tuple[dict[str, Any], float]] = field(default_factory=dict)
    last_ids: dict[str, dict[str, Any]] = field(default_factory=dict)

    def update(self, view: dict[str, Any], now: float) -> list[tuple[dict[str, Any], str]]:
        nodes = {n["node_id"]: n for n in view.get("nodes") or []}
        for node_id, doc in self.last_ids.items():
            if node_id not in nodes and node_id not in self.gone:
                self.gone[node_id] = (doc, now)
        for node_id in list(self.gone):
            if node_id in nodes or now - self.gone[node_id][1] > GONE_KEEP_S:
                del self.gone[node_id]
        self.last_ids = nodes
        rows = [(doc, node_state(doc)) for doc in nodes.values()]
        rows += [(doc, "gone") for doc, _ in self.gone.values()]
        return sorted(rows, key=lambda row: str(row[0].get("node_id")))

    def render(self, view: dict[str, Any], url: str, now: float, width: int = 200) -> RenderableType:
        pool = view.get("pool") or {}
        header = Text()
        header.append("macpool ", style="bold")
        header.append(f"{url}  router {view.get('router_id', '?')}  ")
        redis_ok = bool(view.get("redis_ok"))
        header.append("redis ok" if redis_ok else "redis DOWN", "green" if redis_ok else "bold red")
        saturation = 100 * float(pool.get("saturation") or 0)
        totals = Text(
            f"capacity {pool.get('capacity', 0)}  busy {pool.get('busy', 0)}  "
            f"queued {pool.get('queued', 0)}  "
            f"nodes {pool.get('nodes_ready', 0)}/{pool.get('nodes_total', 0)} ready  "
            f"req/s {_num(pool.get('requests_per_s'))}  saturation {saturation:.0f}%  "
        )
        rejections = float(pool.get("rejections_per_s") or 0)
        totals.append(f"503/s {rejections:.1f}", "bold red" if rejections > 0 else "")
        affinity = view.get("affinity") or {}
        if affinity.get("enabled"):
            rate = affinity.get("hit_rate")
            totals.append("  affinity hits " + ("-" if rate is None else f"{100 * float(rate):.0f}%"))
        queues = Text()
        for tenant in view.get("tenants") or []:
            queued = tenant.get("queued") or {}
            interactive, batch = queued.get("interactive", 0), queued.get("batch", 0)
            queues.append(f"{tenant.get('tenant')}: {tenant.get('in_flight') or 0} in flight, "
                          f"queued {interactive} interactive / {batch} batch   ")

        columns = COLUMNS if width >= REASON_MIN_WIDTH else COLUMNS[:-1]
        table = Table(box=box.SIMPLE_HEAD, header_style="bold", pad_edge=False)
        for column in columns:
            right = column in ("resv", "KV cells", "tok/s", "TTFT")
            table.add_column(column, justify="right" if right else "left", no_wrap=column != "reason")
        for doc, state in self.update(view, now):
            memory = doc.get("memory") or {}
            capacity = int(doc.get("capacity") or 0)
            # the router's reservations lead the agent's heartbeat: show the larger
            in_flight = max(int(doc.get("in_flight") or 0), int(doc.get("reserved") or 0))
            pinned, limit = float(memory.get("pinned_gb") or 0), float(memory.get("wired_limit_gb") or 0)
            ttft = doc.get("ttft_p50_ms")
            # what Redis says (node ids, models, reasons) is shown as text: never read as rich markup
            cells: list[RenderableType] = [
                Text(str(doc.get("node_id"))),
                Text(state, STATE_STYLE.get(state, "")),
                Text(models_text(doc)),
                f"{_bar(in_flight, max(capacity, 1), 8)} {in_flight:>2}/{capacity:<2}",
                str(doc.get("reserved", "-")),
                _cells(doc),
                f"{_bar(pinned, limit, 8)} {pinned:5.1f}/{limit:.0f}" if limit else "-",
                _num(doc.get("tokens_per_s"), 0),
                "-" if ttft is None else f"{float(ttft):.0f}ms",
                Text("left the pool" if state == "gone" else _reason(doc)),
            ]
            table.add_row(*cells[: len(columns)], style="dim" if state == "gone" else "")
        if not table.rows:
            table.add_row("(no node in the pool)", *[""] * (len(columns) - 1))
        return Group(header, totals, queues, table) if queues else Group(header, totals, table)


def _kilo(n: int) -> str:
    return f"{n / 1024:.0f}K" if n >= 1024 else str(n)


def _cells(doc: dict[str, Any]) -> str:
    """The KV cells llama-server holds of its cache ("shared": one pool for every slot), "-" when unknown."""
    cells = int(doc.get("kv_cells") or 0)
    if not cells:
        return "-"
    used = int(doc.get("kv_cells_used") or 0)
    return f"{_kilo(used)}/{_kilo(cells)}" + (" shared" if doc.get("kv_unified") else "")


def fetch(client: httpx.Client, url: str) -> dict[str, Any]:
    response = client.get(url.rstrip("/") + "/api/pool", timeout=5.0)
    if response.status_code == 401:
        raise httpx.HTTPStatusError(
            "401: the router needs its read key (MACPOOL_READ_KEY or --read-key-file)",
            request=response.request, response=response)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="macpool top", description=__doc__)
    parser.add_argument(
        "--router", default=os.environ.get("MACPOOL_ROUTER_URL", "http://127.0.0.1:8080"),
        help="router base URL (env MACPOOL_ROUTER_URL; default %(default)s)",
    )
    parser.add_argument(
        "--read-key-file", type=Path,
        help="file holding the router's read key (or its admin key), when it needs one; or set "
        "MACPOOL_READ_KEY",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        print(f"macpool top: invalid --interval={args.interval}: must be > 0", file=sys.stderr)
        return 2
    try:
        key = read_secret(args.read_key_file, "--read-key-file") if args.read_key_file else None
    except SecretError as exc:
        print(f"macpool top: {exc}", file=sys.stderr)
        return 2
    key = key or os.environ.get("MACPOOL_READ_KEY") or None
    view_state = TopView()
    # not a terminal (a pipe, a file, a cron job's mail): rich would assume 80 columns and wrap the figures
    # away from their labels, unless COLUMNS says otherwise
    wide = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    console = Console(width=160) if wide else Console()
    with httpx.Client(headers={"Authorization": f"Bearer {key}"} if key else None) as client:
        if args.once:
            try:
                view = fetch(client, args.router)
                console.print(view_state.render(view, args.router, time.monotonic(), console.width))
            except (httpx.HTTPError, ValueError) as exc:
                print(f"macpool top: cannot read {args.router}/api/pool: {exc}", file=sys.stderr)
                return 1
            return 0
        return _live(client, console, view_state, args.router, args.interval)


def _live(client: httpx.Client, console: Console, view_state: TopView, url: str, interval: float) -> int:
    with Live(Text("connecting..."), console=console, screen=False, auto_refresh=False) as live:
        next_at = time.monotonic()
        try:
            while True:
                try:
                    frame = view_state.render(fetch(client, url), url, time.monotonic(), console.width)
                except (httpx.HTTPError, ValueError) as exc:
                    frame = Text(f"cannot read {url}/api/pool: {exc} (retrying)", style="red")
                live.update(frame, refresh=True)
                next_at += interval
                time.sleep(max(0.0, next_at - time.monotonic()))
        except KeyboardInterrupt:
            return 0
