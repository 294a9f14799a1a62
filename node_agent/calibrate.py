"""``macpool agent calibrate``: measure a Mac's ceiling instead of copying a table.

Drive concurrency up in steps with a fixed prompt length - by default near the context one request may hold
on the server (its slots' context less the output): the requests the operator sized the Mac for, whose
prefill makes the knee lower than short prompts would - record throughput, p50 latency, TTFT and pinned
memory, and recommend the cap: the smaller of two knees - memory (the level before pinned memory nears the
wired limit) and throughput saturation (the smallest level reaching 95% of the best healthy throughput: past
it, every admitted request only makes the others slower). A level where more than 5% of requests fail ends
the healthy range too. Optional latency bounds pick the largest level meeting them instead of the
throughput knee.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from macpool import plotting

from . import kv
from .heartbeat import training_context
from .loadgen import Clock, Level, LevelResult, chars_per_token

NEAR_LIMIT = 0.85  # pinned at this share of the wired limit "nears" it
SATURATED = 0.95  # the throughput knee: the smallest level reaching this share of the best healthy throughput
CONFIRM = 2  # healthy levels past a throughput knee before it holds (one noisy dip never decides)
MIN_LEVELS = 4  # healthy levels before a throughput knee holds: a curve through three says little
DIP = 0.90  # a healthy level below this share of the best before it is measured again
MAX_ERROR_RATE = 0.05  # failed requests above this share at a level: a knee signal...
MIN_ERRORS = 3  # ...once there are this many (one connection reset in a short window is no knee)
PAGING_STATES = ("paging", "collapsed")


@dataclass
class Bounds:
    """Optional latency bounds: the cap is then the largest healthy level meeting them all."""

    max_p50_ratio: float | None = None  # p50 over the lowest level's p50
    max_ttft_s: float | None = None  # TTFT p50, seconds

    def __bool__(self) -> bool:
        return self.max_p50_ratio is not None or self.max_ttft_s is not None

    def met(self, row: LevelResult, base_p50: float) -> bool:
        ratio_ok = self.max_p50_ratio is None or row.p50_latency_s <= self.max_p50_ratio * base_p50
        ttft_ok = self.max_ttft_s is None or row.ttft_p50_s <= self.max_ttft_s
        return ratio_ok and ttft_ok

    def describe(self) -> str:
        parts = []
        if self.max_p50_ratio is not None:
            parts.append(f"--max-p50-ratio {self.max_p50_ratio:g}")
        if self.max_ttft_s is not None:
            parts.append(f"--max-ttft {self.max_ttft_s:g}")
        return " and ".join(parts)


@dataclass
class Knee:
    recommended_cap: int
    # "memory", "throughput", "errors", "latency" (a bound) or "none" (no knee up to the highest level)
    limited_by: str
    per_request_gb: float | None
    weights_gb: float | None
    wired_limit_gb: float | None
    memory_knee: int | None = None  # the last level before pinned memory neared the wired limit
    throughput_knee: int | None = None  # the smallest level reaching SATURATED x the best healthy throughput
    error_knee: int | None = None  # the last level before more than MAX_ERROR_RATE of requests failed
    latency_cap: int | None = None  # with bounds: the largest healthy level meeting them
    reason: str = ""


def memory_hit(row: LevelResult) -> bool:
    pinned, limit = row.peak_pinned_gb, row.wired_limit_gb
    near = pinned is not None and bool(limit) and pinned >= NEAR_LIMIT * (limit or 0.0)
    return near or row.state in PAGING_STATES


def error_hit(row: LevelResult) -> bool:
    return row.errors >= MIN_ERRORS and row.error_rate > MAX_ERROR_RATE


def _first(rows: list[LevelResult], hit: Any) -> int | None:
    return next((i for i, row in enumerate(rows) if hit(row)), None)


def _before(rows: list[LevelResult], index: int | None) -> int | None:
    """The knee a signal at ``index`` sets: the level before it (0 when it fired at the first level)."""
    if index is None:
        return None
    return rows[index - 1].concurrency if index > 0 else 0


def healthy_rows(rows: list[LevelResult]) -> list[LevelResult]:
    """The rows before the first level past the memory or the error knee."""
    bad = [i for i in (_first(rows, memory_hit), _first(rows, error_hit)) if i is not None]
    return rows[: min(bad)] if bad else rows


def neighbour_medians(values: list[float]) -> list[float]:
    """Each value read as the median of it and its neighbours: one lucky or unlucky window moves nothing."""
    return [statistics.median(values[max(0, i - 1) : i + 2]) for i in range(len(values))]


def fitted(healthy: list[LevelResult]) -> list[float]:
    """Each level's throughput on the saturating curve ``A x c / (c + h)`` fitted to all healthy levels.

    A closed loop of long prefills falls into lucky and unlucky patterns, so one level can read 10% off its
    neighbours; a fit over every level (least squares of ``c / throughput`` against ``c``, a straight line
    for that curve) lets no single dip or spike decide the knee or set the bar. Curves it does not describe
    (fewer than three levels, throughput growing faster than linearly) use the median of each level and
    its neighbours instead.
    """
    values = [r.throughput_tok_s for r in healthy]
    points = [(r.concurrency, r.concurrency / r.throughput_tok_s) for r in healthy if r.throughput_tok_s > 0]
    slope, intercept = _line(points) if len(points) == len(healthy) >= 3 else (None, None)
    if slope is None or intercept is None or slope <= 0 or intercept < 0:
        return neighbour_medians(values)
    return [r.concurrency / (slope * r.concurrency + intercept) for r in healthy]


def rising(healthy: list[LevelResult]) -> list[LevelResult]:
    """The levels the saturating curve is fitted to: up to the top of a flat top, else all.

    A curve that bends gradually is fitted over every level. One that stops rising at once (the GPU's
    compute used up: a roofline) is not: fitted with its flat tail, the saturating curve bends late and puts
    the knee one or two levels past the top. The top is the first level of the highest throughput, each
    level read as the median of it and its neighbours (one lucky window is no top); it holds once CONFIRM
    levels past it did not rise above it.
    """
    smooth = neighbour_medians([r.throughput_tok_s for r in healthy])
    top = smooth.index(max(smooth))
    return healthy[: top + 1] if len(healthy) - 1 - top >= CONFIRM else healthy


def _saturation(healthy: list[LevelResult]) -> tuple[int, float]:
    """The index of the smallest level reaching SATURATED x the best fitted throughput, and that best."""
    levels = fitted(rising(healthy))
    best = max(levels)
    return next(i for i, value in enumerate(levels) if value >= SATURATED * best), best


def _throughput_candidate(healthy: list[LevelResult]) -> int | None:
    return _saturation(healthy)[0] if healthy else None


def throughput_confirmed(healthy: list[LevelResult]) -> bool:
    index = _throughput_candidate(healthy)
    return index is not None and len(healthy) - 1 - index >= CONFIRM and len(healthy) >= MIN_LEVELS


def _throughput_knee(healthy: list[LevelResult], complete: bool) -> int | None:
    """The saturation level, once CONFIRM healthy levels past it did not lift the best; or, when the sweep
    could go no further, any candidate that is not the last healthy level (there, throughput still grew)."""
    index = _throughput_candidate(healthy)
    if index is None:
        return None
    if throughput_confirmed(healthy) or (complete and index < len(healthy) - 1):
        return healthy[index].concurrency
    return None


def find_knee(rows: list[LevelResult], bounds: Bounds | None = None, complete: bool = True) -> Knee:
    """The recommended cap for measured rows (sorted by concurrency), on any machine, and why.

    The smaller of the memory knee and the throughput knee (with ``bounds``: the largest healthy level
    meeting them, instead of the throughput knee); a level where requests failed ends the healthy range too.
    """
    bounds = bounds or Bounds()
    mem_index, err_index = _first(rows, memory_hit), _first(rows, error_hit)
    healthy = healthy_rows(rows)
    memory_knee, error_knee = _before(rows, mem_index), _before(rows, err_index)
    throughput_knee = _throughput_knee(healthy, complete)
    latency_cap: int | None = None
    if bounds and rows:
        meeting = [r.concurrency for r in healthy if bounds.met(r, rows[0].p50_latency_s)]
        latency_cap = max(meeting, default=0)
    knees = {"memory": memory_knee, "errors": error_knee}
    knees["latency" if bounds else "throughput"] = latency_cap if bounds else throughput_knee
    known = {name: value for name, value in knees.items() if value is not None}
    if known:
        limited_by = min(known, key=lambda name: known[name])
        cap = known[limited_by]
    else:
        limited_by, cap = "none", (healthy[-1].concurrency if healthy else 0)
    per_request, weights = _memory_line(healthy or rows)
    limit = next((r.wired_limit_gb for r in rows if r.wired_limit_gb), None)
    knee = Knee(cap, limited_by, per_request, weights, limit, memory_knee, throughput_knee, error_knee,
                latency_cap)
    knee.reason = explain(rows, knee, bounds)
    return knee


def explain(rows: list[LevelResult], knee: Knee, bounds: Bounds) -> str:
    """One sentence per signal, then the choice."""
    said: list[str] = []
    mem_index, err_index = _first(rows, memory_hit), _first(rows, error_hit)
    if mem_index is not None:
        row = rows[mem_index]
        pinned = "-" if row.peak_pinned_gb is None else f"{row.peak_pinned_gb:.1f} GB"
        limit = "-" if row.wired_limit_gb is None else f"{row.wired_limit_gb:.1f} GB"
        said.append(f"memory knee {knee.memory_knee}: pinned {pinned} of the {limit} wired limit "
                    f"({row.state or 'near it'}) at {row.concurrency}")
    else:
        peak = max((r.peak_pinned_gb for r in rows if r.peak_pinned_gb is not None), default=None)
        said.append("memory knee not reached" + ("" if peak is None else f" (pinned at most {peak:.1f} GB)"))
    if err_index is not None:
        row = rows[err_index]
        attempted = row.errors + row.succeeded
        said.append(f"errors at {row.concurrency}: {row.errors} of {attempted} requests failed "
                    f"(knee {knee.error_knee}; last: {row.last_error or '-'})")
    healthy = healthy_rows(rows)
    if healthy:
        if knee.throughput_knee is not None:
            said.append(f"throughput knee {knee.throughput_knee}: {SATURATED:.0%} of the best "
                        f"{_saturation(healthy)[1]:.1f} tok/s (fitted); more only adds latency")
        else:
            said.append(f"throughput still growing at {healthy[-1].concurrency} "
                        f"({healthy[-1].throughput_tok_s:.1f} tok/s)")
    if bounds:
        said.append(f"largest level meeting {bounds.describe()}: {knee.latency_cap}")
    if knee.limited_by == "none":
        chose = f"cap {knee.recommended_cap}: no knee up to the highest level measured"
    else:
        chose = f"cap {knee.recommended_cap}, limited by {knee.limited_by}"
    return "; ".join(said) + f" -> {chose}"


def advice(knee: Knee, bounds: Bounds) -> str:
    """What to change when no level is safe (the recommended cap would be 0)."""
    if knee.limited_by == "memory":
        return ("the model and its KV cache already fill the wired limit at the first level: start "
                "llama-server with fewer --parallel slots or a smaller --ctx-size, use a smaller model or "
                "quantization, close what else pins memory, or raise the wired limit (iogpu.wired_limit_mb)")
    if knee.limited_by == "errors":
        return ("requests fail at the first level: read llama-server's log, check --model, and that "
                "--prompt-tokens + --max-tokens fit one slot's context")
    return (f"no level meets {bounds.describe()}: loosen the bound, or lower --prompt-tokens to what "
            "your clients really send")


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
    """Least-squares slope and intercept (None, None when the points do not define a line)."""
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


DEFAULT_PROMPT_TOKENS = 4096  # a server that does not say its context
MIN_MARGIN = 64  # tokens a prompt near the context leaves free beside the output: the unique tag, BOS


@dataclass
class CalibrateOptions:
    upstream: str
    prompt_tokens: int | None = None  # None: near the context one request may hold (``near_context``)
    max_tokens: int = 1024
    max_concurrency: int = 24
    step: int = 1
    window_requests: int = 0  # 0: 6 x concurrency, at least 16
    model: str | None = None
    levels: list[int] = field(default_factory=list)
    bounds: Bounds = field(default_factory=Bounds)

    def concurrency_levels(self) -> list[int]:
        if self.levels:
            return sorted(set(self.levels))
        return list(range(1, self.max_concurrency + 1, self.step))

    def window(self, concurrency: int) -> int:
        # six rounds per client: enough that two sweeps of one machine agree within one level
        return self.window_requests or max(16, 6 * concurrency)


def near_context(seq_ctx: int, max_tokens: int) -> int:
    """A prompt near the context one request may hold: the context less the output and a small margin
    (the prompt's length is the server tokenizer's, measured on the filler text, give or take the tag)."""
    prompt = seq_ctx - max_tokens - max(MIN_MARGIN, seq_ctx // 100)
    if prompt < 1:
        raise ValueError(f"the server holds {seq_ctx} tokens a request: --max-tokens {max_tokens} leaves no "
                         "room for a prompt")
    return prompt


@dataclass
class Plan:
    """What a sweep measures, decided from what the server says before it starts."""

    prompt_tokens: int
    chars_per_token: float  # the server tokenizer's, for prompts of the right length
    levels: list[int]
    seq_ctx: int  # the context one request may hold (0: the server does not say)
    notes: list[str] = field(default_factory=list)  # said before the sweep: the prompt, levels left out


async def plan(client: httpx.AsyncClient, base: str, options: CalibrateOptions) -> Plan:
    """The prompt length and the levels: none above the server's slots (they would queue inside it), nor
    above what a shared KV cache holds of such requests at once (llama-server fails every running request
    when its cells run out)."""
    response = await client.get(base + "/props", timeout=10)
    response.raise_for_status()
    props = response.json()
    slots = int(props.get("total_slots") or 0)
    seq_ctx = int(props.get("default_generation_settings", {}).get("n_ctx") or 0)
    notes = []
    prompt = options.prompt_tokens
    if prompt is None:
        prompt = near_context(seq_ctx, options.max_tokens) if seq_ctx else DEFAULT_PROMPT_TOKENS
        where = f"near the {seq_ctx} tokens a request may hold" if seq_ctx else "the server says no context"
        notes.append(f"prompts of {prompt} tokens ({where}), {options.max_tokens} generated")
    levels = [c for c in options.concurrency_levels() if not slots or c <= slots]
    if not levels:
        raise ValueError(f"the server has only {slots} slots; start it with --parallel >= the levels")
    if slots and seq_ctx:
        models = await client.get(base + "/v1/models", timeout=10)
        train = training_context(models.json().get("data")) if models.status_code == 200 else 0
        found = await kv.attached_async(base, [], slots)
        cache = kv.layout(found.args, slots, seq_ctx, train)
        if cache.unified:
            fits = max(1, cache.cells // (prompt + options.max_tokens))
            if any(c > fits for c in levels):
                many = f"{fits} request{'s' if fits > 1 else ''}"
                notes.append(f"levels above {fits} left out: the {slots} slots share {cache.cells} KV cells "
                             f"({found.said}), room for {many} of {prompt} + {options.max_tokens} tokens")
                levels = [c for c in levels if c <= fits]
    return Plan(prompt, await chars_per_token(client, base), levels, seq_ctx, notes)


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


def dipped(rows: list[LevelResult], row: LevelResult) -> bool:
    """A healthy level reading below DIP x the best level before it: measured again, the better window kept.

    A saturating curve does not fall, and one unlucky window at the fourth level would otherwise confirm
    the first level as the knee and end the sweep there. A drop that is real reads the same twice.
    """
    best = max((r.throughput_tok_s for r in healthy_rows(rows)), default=None)
    healthy = not (memory_hit(row) or error_hit(row))
    return healthy and best is not None and row.throughput_tok_s < DIP * best


def decided(rows: list[LevelResult], bounds: Bounds) -> bool:
    """Nothing further can change the cap: stop (levels past a knee are slow and say little)."""
    if any(memory_hit(r) or error_hit(r) for r in rows):
        return True
    if bounds:
        base = rows[0].p50_latency_s
        return len(rows) >= 2 and not any(bounds.met(r, base) for r in rows[-CONFIRM:])
    return throughput_confirmed(rows)


async def sweep(options: CalibrateOptions, progress: Any = None,
                announce: Callable[[str], None] | None = None) -> tuple[list[LevelResult], Knee, Plan]:
    """Measure level after level; stop once the knee is decided. ``announce`` hears the plan's notes."""
    base = options.upstream.rstrip("/")
    timeout = httpx.Timeout(600, connect=5)
    rows: list[LevelResult] = []
    # idle connections are dropped well before llama-server closes them (5 s): a request sent on one it is
    # closing fails without an answer, and would count as an error of the level
    limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        clock = Clock(client, base)
        await clock.detect()
        planned = await plan(client, base, options)
        if announce is not None:
            for note in planned.notes:
                announce(note)

        async def measure(concurrency: int) -> LevelResult:
            await _settle(client, base)
            level = Level(
                client,
                base,
                clock,
                concurrency,
                planned.prompt_tokens,
                options.max_tokens,
                options.model,
                options.window(concurrency),
                chars_per_token=planned.chars_per_token,
            )
            return await level.run()

        for concurrency in planned.levels:
            row = await measure(concurrency)
            if dipped(rows, row):
                again = await measure(concurrency)
                row = max(row, again, key=lambda r: r.throughput_tok_s)
            rows.append(row)
            if progress is not None:
                progress(rows[-1])
            if decided(rows, options.bounds):
                break
        await _settle(client, base)
    return rows, find_knee(rows, options.bounds), planned


def result_json(rows: list[LevelResult], knee: Knee, options: CalibrateOptions,
                planned: Plan | None = None) -> dict[str, Any]:
    base = rows[0].p50_latency_s if rows and rows[0].p50_latency_s else 1.0
    return {
        "recommended_cap": knee.recommended_cap,
        "limited_by": knee.limited_by,
        "memory_knee": knee.memory_knee,
        "throughput_knee": knee.throughput_knee,
        "error_knee": knee.error_knee,
        "latency_cap": knee.latency_cap,
        "reason": knee.reason,
        "max_p50_ratio": options.bounds.max_p50_ratio,
        "max_ttft_s": options.bounds.max_ttft_s,
        "per_request_gb": knee.per_request_gb,
        "weights_gb": knee.weights_gb,
        "wired_limit_gb": knee.wired_limit_gb,
        "prompt_tokens": planned.prompt_tokens if planned else options.prompt_tokens,
        "max_tokens": options.max_tokens,
        "context": planned.seq_ctx if planned else None,
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
    fig.suptitle(
        f"recommended cap {knee.recommended_cap} (limited by {knee.limited_by}; memory knee "
        f"{knee.memory_knee if knee.memory_knee is not None else '-'}, throughput knee "
        f"{knee.throughput_knee if knee.throughput_knee is not None else '-'})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def dump_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
