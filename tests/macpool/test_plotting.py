"""Plots are an optional extra: without matplotlib a --plot says how to install it, before any run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from macpool import plotting

# matplotlib made unimportable in the child: `import matplotlib` raises ImportError for a None entry
WITHOUT_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "
MESSAGE = "macpool: plots need matplotlib, which is not installed: pip install 'macpool[plot]'"


def _without_matplotlib(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB + code], capture_output=True, text=True, timeout=60
    )


def test_the_helper_draws_with_agg(tmp_path: Path) -> None:
    plt = plotting.pyplot()
    assert plt.get_backend().lower() == "agg"
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    fig.savefig(tmp_path / "a.png")
    plt.close(fig)
    assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")


def test_the_helper_names_the_extra_without_matplotlib() -> None:
    done = _without_matplotlib(
        "from macpool import plotting\n"
        "try:\n    plotting.pyplot()\n"
        "except plotting.PlotUnavailable as exc:\n    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == MESSAGE.removeprefix("macpool: ") + "\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "sweep", "--target", "http://127.0.0.1:9"],
        ["bench", "seed-table"],
        ["bench", "overload"],
        ["agent", "calibrate", "--upstream", "http://127.0.0.1:9"],
    ],
    ids=["sweep", "seed-table", "overload", "calibrate"],
)
def test_plot_without_matplotlib_is_one_line_and_exit_2_before_the_run(
    argv: list[str], tmp_path: Path
) -> None:
    png = tmp_path / "out.png"
    done = _without_matplotlib(
        f"from macpool.cli import main; raise SystemExit(main({[*argv, '--plot', str(png)]!r}))"
    )
    # nothing ran: a sweep of port 9 would exit 1 ("cannot reach"), overload would start a pool
    assert (done.returncode, done.stderr, done.stdout) == (2, MESSAGE + "\n", "")
    assert not png.exists()


def test_router_agent_and_simulator_import_without_matplotlib() -> None:
    done = _without_matplotlib(
        # an import of matplotlib anywhere in these would raise ImportError
        "import router.app, router.cli, node_agent.agent, node_agent.cli, macpool.sim.app, macpool.cli\n"
        "import macpool.bench.cli"
    )
    assert done.returncode == 0, done.stderr


def test_the_bench_figure_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    png = tmp_path / "perf.png"
    done = _without_matplotlib(
        f"from macpool.bench.plot import main; raise SystemExit(main([{str(tmp_path)!r}, {str(png)!r}]))"
    )
    assert (done.returncode, done.stderr, done.stdout) == (2, MESSAGE + "\n", "")
    assert not png.exists()
