"""``macpool agent calibrate``: measure a Mac's ceiling instead of copying a table.

Drive concurrency up in steps with a fixed prompt length, record throughput, p50 latency and pinned memory,
and recommend the cap: the concurrency just before pinned memory nears the wired limit, p50 latency stops
rising linearly (hockey stick), or throughput starts to fall - whichever comes first.
"""

from __future__ import annotations

import asyncio
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool import plotting

from .loadgen import Clock, Level, LevelResult

NEAR_LIMIT = 0.85  # pinned at this share of the wired limit "nears" it
LATENCY_BEND = 1.3  # p50 this far above the line through the earlier levels: the hockey stick
THROUGHPUT_DROP = 0.9  # throughput below this share of the best so far: falling
THROUGHPUT_GAIN = 1.05  # less than this gain over the best so far: no longer growing
PAST_KNEE = 2  # levels measured past the knee, for the curve


@dataclass
class Knee:
    recommended_cap: int
    limited_by: str  # "memory", "latency", "throughput" or "none" (no knee up to the highest level)
    per_request_gb: float | None
    weights_gb: float | None
    wired_limit_gb: float | None


def _first_failure(rows: list[LevelResult]) -> tuple[int, str] | None:
    """Index of the first row past the knee, and which signal says so."""
    best = 0.0
    for i, row in enumerate(rows):
        pinned, limit = row.peak_pinned_gb, row.wired_limit_gb
        if pinned is not None and limit and pinned >= NEAR_LIMIT * limit:
            return i, "memory"
        if i > 0 and row.throughput_tok_s < THROUGHPUT_DROP * best:
            return i, "throughput"
        # the hockey stick: p50 well above its line while throughput no longer grows (p50 alone is noisy)
        bent = i >= 2 and row.p50_latency_s > LATENCY_BEND * _linear_p50(rows[:i], row.concurrency)
        if bent and row.throughput_tok_s < THROUGHPUT_GAIN * best:
            return i, "latency"
        best = max(best, row.throughput_tok_s)
    return None


def _linear_p50(rows: list[LevelResult], concurrency: int) -> float:
    """p50 at ``concurrency`` if it kept rising along the least-squares line through the earlier rows."""
    slope, intercept = _line([(r.concurrency, r.p50_latency_s) for r in rows])
    if slope is None or intercept is None:
        return rows[-1].p50_latency_s
    return max(intercept + max(slope, 0.0) * concurrency, rows[-1].p50_latency_s)


def find_knee(rows: list[LevelResult]) -> Knee:
    """The recommended cap for measured rows (sorted by concurrency), on any machine."""
    failure = _first_failure(rows)
    if failure is None:
        cap, limited_by, healthy = rows[-1].concurrency, "none", rows
    else:
        index, limited_by = failure
        cap = rows[index - 1].concurrency if index > 0 else 0
        healthy = rows[:index]
    per_request, weights = _memory_line(healthy or rows)
    limit = next((r.wired_limit_gb for r in rows if r.wired_limit_gb), None)
    return Knee(cap, limited_by, per_request, weights, limit)


def _memory_line(rows: list[LevelResult]) -> tuple[float | None, float | None]:
    """Least-squares pinned = weights + c x per_request over the healthy rows."""
    points = [(r.concurrency, r.peak_pinned_gb) for r in rows if r.peak_pinned_gb is not None]
    slope, intercept = _line(points)
    if slope is None or intercept is None:
        return None, None
    # pinned memory that did not grow with concurrency (llama-server allocates its KV cache for all of
    # --ctx-size at start; or noise between nearly equal readings) says nothing about a request's share:
    # no figure, rather than a zero or negative one the agent cannot use
    per_request = round(slope, 4)
    return (per_request if per_request > 0 else None), round(intercept, 3)


def _line(points: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    if len(points) < 2:
        return None, None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return None, None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return slope, mean_y - slope * mean_x


@dataclass
class CalibrateOptions:
    upstream: str
    prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_concurrency: int = 24
    step: int = 1
    window_requests: int = 0  # 0: 2 x concurrency, at least 6
    model: str | None = None
    levels: list[int] = field(default_factory=list)

    def concurrency_levels(self) -> list[int]:
        if self.levels:
            return sorted(set(self.levels))
        return list(range(1, self.max_concurrency + 1, self.step))


async def _settle(client: httpx.AsyncClient, base: str) -> None:
    """Wait until the previous level's cancelled requests have left the server."""
    for _ in range(200):
        try:
            response = await client.get(base + "/metrics", timeout=5)
            if "llamacpp:requests_processing 0" in response.text:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)


async def total_slots(client: httpx.AsyncClient, base: str) -> int | None:
    """llama-server's slot count: levels above it would queue inside the server and read as latency."""
    response = await client.get(base + "/props", timeout=10)
    response.raise_for_status()
    slots = response.json().get("total_slots")
    return int(slots) if slots else None


async def sweep(options: CalibrateOptions, progress: Any = None) -> tuple[list[LevelResult], Knee]:
    """Measure level after level; stop a few levels past the knee (paging levels are slow, say little)."""
    base = options.upstream.rstrip("/")
    timeout = httpx.Timeout(600, connect=5)
    rows: list[LevelResult] = []
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        clock = Clock(client, base)
        await clock.detect()
        slots = await total_slots(client, base)
        levels = [c for c in options.concurrency_levels() if slots is None or c <= slots]
        if not levels:
            raise ValueError(f"the server has only {slots} slots; start it with --parallel >= the levels")
        for concurrency in levels:
            await _settle(client, base)
            window = options.window_requests or max(6, 2 * concurrency)
            level = Level(
                client,
                base,
                clock,
                concurrency,
                options.prompt_tokens,
                options.max_tokens,
                options.model,
                window,
            )
            rows.append(await level.run())
            if progress is not None:
                progress(rows[-1])
            failure = _first_failure(rows)
            if failure is not None and len(rows) - 1 - failure[0] >= PAST_KNEE:
                break
        await _settle(client, base)
    return rows, find_knee(rows)


def result_json(rows: list[LevelResult], knee: Knee, options: CalibrateOptions) -> dict[str, Any]:
    base = rows[0].p50_latency_s if rows else 1.0
    return {
        "recommended_cap": knee.recommended_cap,
        "limited_by": knee.limited_by,
        "per_request_gb": knee.per_request_gb,
        "weights_gb": knee.weights_gb,
        "wired_limit_gb": knee.wired_limit_gb,
        "prompt_tokens": options.prompt_tokens,
        "max_tokens": options.max_tokens,
        "rows": [{**asdict(r), "p50_ratio": round(r.p50_latency_s / base, 3)} for r in rows],
    }


def write_config(path: Path, knee: Knee) -> None:
    """Set ``calibrated_cap`` / ``calibrated_per_request_gb`` in an agent TOML config, keeping other lines.

    The keys go where ``agent run --config`` reads them: into the ``[agent]`` table when the file has one
    (the agent then reads only that table; ``agent.`` dotted keys when the table is made of those), else at
    the top level, before the first table.
    """
    values: dict[str, str] = {"calibrated_cap": str(knee.recommended_cap)}
    if knee.per_request_gb:
        values["calibrated_per_request_gb"] = repr(knee.per_request_gb)
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines()
    ours = r"\s*(agent\s*\.\s*)?(calibrated_cap|calibrated_per_request_gb)\s*="
    kept = [ln for ln in lines if not re.match(ours, ln)]
    tables = [i for i, ln in enumerate(kept) if ln.lstrip().startswith("[")]
    agent = [i for i in tables if re.match(r"\s*\[\s*agent\s*\]\s*(#.*)?$", kept[i])]
    at = agent[0] + 1 if agent else (tables[0] if tables else len(kept))
    dotted = not agent and "agent" in tomllib.loads(text)  # agent.upstream = ... at the top level
    new = [f"{'agent.' if dotted else ''}{key} = {value}" for key, value in values.items()]
    path.write_text("\n".join([*kept[:at], *new, *kept[at:]]) + "\n")


def plot(path: Path, rows: list[LevelResult], knee: Knee) -> None:
    plt = plotting.pyplot()

    xs = [r.concurrency for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(xs, [r.throughput_tok_s for r in rows], marker="o")
    axes[0].set_title("aggregate throughput (tok/s)")
    axes[1].plot(xs, [r.p50_latency_s for r in rows], marker="o", color="tab:orange")
    axes[1].set_title("p50 latency (s)")
    pinned = [r.peak_pinned_gb for r in rows]
    if any(p is not None for p in pinned):
        axes[2].plot(
            xs, [p if p is not None else float("nan") for p in pinned], marker="o", color="tab:green"
        )
        if knee.wired_limit_gb:
            axes[2].axhline(knee.wired_limit_gb, color="red", linestyle="--", label="wired limit")
            axes[2].legend()
    axes[2].set_title("peak pinned memory (GB)")
    for ax in axes:
        ax.axvline(knee.recommended_cap, color="grey", linestyle=":")
        ax.set_xlabel("concurrency")
    fig.suptitle(f"recommended cap {knee.recommended_cap} (limited by {knee.limited_by})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dump_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
