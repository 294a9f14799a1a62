"""One figure from the results of ``macpool bench overhead``, ``peers`` and ``relay``:
``python -m macpool.bench.plot RESULTS_DIR OUT.png`` (needs ``pip install 'macpool[plot]'``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from macpool import plotting


def plot(folder: Path, out: Path) -> None:
    """One figure from the JSON files the benches wrote into ``folder`` (whichever exist)."""
    plt = plotting.pyplot()

    def load(name: str) -> dict[str, Any] | None:
        path = folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    overhead, peers, relay = load("overhead"), load("peers"), load("relay")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    if overhead:
        levels = sorted(overhead["levels"], key=int)
        xs = [int(x) for x in levels]
        for key, label in (("ttft_added", "router + agent"), ("router_only_ttft_added", "router only")):
            for q, style in (("p50", "-o"), ("p99", "--o")):
                ys = [overhead["levels"][lv].get(f"{key}_{q}_ms") for lv in levels]
                ax.plot(
                    xs, [max(y, 0.01) if y is not None else None for y in ys], style, label=f"{label} {q}"
                )
        ax.axhline(1.0, color="green", lw=0.8, ls=":", label="target p50 1 ms")
        ax.axhline(5.0, color="red", lw=0.8, ls=":", label="target p99 5 ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("added TTFT (ms)")
        ax.set_title("bench overhead: added TTFT vs direct")
        ax.legend(fontsize=7)
    ax = axes[1]
    if peers:
        levels = sorted(peers["ttft"], key=int)
        width = 0.25
        for i, name in enumerate(("macpool", "nginx", "litellm")):
            raw = [peers["ttft"][lv][name].get("ttft_added_p50_ms") for lv in levels]
            bar_x = [j + (i - 1) * width for j in range(len(levels))]
            ys = [float("nan") if y is None else max(y, 0.01) for y in raw]
            ax.bar(bar_x, ys, width, label=name, color=f"C{i}")
            for x, y in zip(bar_x, raw, strict=True):
                label = "n/a" if y is None else ("<=0" if y <= 0 else "")
                if label:
                    ax.text(x, 0.012, label, ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(levels)), [f"{lv} streams" for lv in levels])
        ax.set_yscale("log")
        ax.set_ylabel("added TTFT p50 (ms)")
        ax.set_title("bench peers: added TTFT (same run, same nodes)")
        ax.legend(fontsize=8)
    ax = axes[2]
    bars: dict[str, float] = {}
    if peers:
        for name, row in peers["relay"].items():
            if row.get("chunks_per_cpu_s"):
                bars[f"{name}\n(peers)"] = row["chunks_per_cpu_s"]
    if relay and relay.get("chunks_per_s"):
        bars["macpool\n(relay)"] = relay["chunks_per_s"]
    if bars:
        ax.bar(list(bars), list(bars.values()), color=["C0", "C1", "C2", "C0"][: len(bars)])
        ax.axhline(20_000, color="red", lw=0.8, ls=":", label="target 20,000/s per core")
        ax.set_yscale("log")
        ax.set_ylabel("SSE chunks per CPU-second")
        ax.set_title("relay rate per proxy core")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m macpool.bench.plot RESULTS_DIR OUT.png", file=sys.stderr)
        return 2
    try:
        plot(Path(argv[0]), Path(argv[1]))
    except plotting.PlotUnavailable as exc:
        print(f"macpool: {exc}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
