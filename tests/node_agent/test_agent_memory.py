"""The macOS memory parsers, fed recorded ``sysctl`` and ``vm_stat`` output; the command runner."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import psutil
import pytest

from node_agent.memory import (
    GB,
    MemorySample,
    ProbeError,
    SharedProbe,
    _run,
    default_wired_limit_bytes,
    macos_sample,
    parse_swapusage,
    parse_sysctl,
    parse_vm_stat,
)
from tests.node_agent.helpers import LOOPS

FIXTURES = Path(__file__).parent / "fixtures"
GIB = 1024**3


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_command_that_hangs_is_killed_at_the_timeout(loop: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"

    async def hang() -> None:
        async with asyncio.timeout(1):
            await _run(["sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"])

    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        with pytest.raises(TimeoutError):
            runner.run(hang())
        assert not psutil.pid_exists(int(pid_file.read_text()))
        # the output of a command that fails is still read (sysctl exits 1 on an unknown name)
        failing = [sys.executable, "-c", "print('hw.memsize: 1'); exit(1)"]
        assert runner.run(_run(failing)) == "hw.memsize: 1\n"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_missing_command_is_a_probe_error_that_names_it(loop: str, tmp_path: Path) -> None:
    missing = tmp_path / "vm_stat"
    with (
        asyncio.Runner(loop_factory=LOOPS[loop]) as runner,
        pytest.raises(ProbeError, match=f"^{missing}: No such file or directory$"),
    ):
        runner.run(_run([str(missing)]))


def test_default_wired_limit_is_two_thirds_up_to_36_gb_and_three_quarters_above() -> None:
    assert default_wired_limit_bytes(32 * GIB) == int(32 * GIB * 2 / 3)
    assert default_wired_limit_bytes(36 * GIB) == int(36 * GIB * 2 / 3)
    assert default_wired_limit_bytes(128 * GIB) == 96 * GIB


def test_sonoma_default_limit_idle_machine() -> None:
    sample = macos_sample(fixture("sysctl-m5max-128g-sonoma-default.txt"), fixture("vm_stat-m5max-idle.txt"))
    assert sample.total_gb == pytest.approx(137.438953472)
    assert sample.wired_limit_gb == pytest.approx(96 * GIB / GB)  # iogpu.wired_limit_mb 0 -> 3/4
    assert sample.pinned_gb == pytest.approx(198765 * 16384 / GB)
    assert sample.swap_used_gb == 0.0
    assert sample.pressure == "normal"


def test_raised_limit_in_mb_with_swap_and_warning() -> None:
    sample = macos_sample(fixture("sysctl-m5max-128g-raised-warning.txt"), fixture("vm_stat-m5max-busy.txt"))
    assert sample.wired_limit_gb == pytest.approx(110000 * 1024 * 1024 / GB)
    assert sample.pinned_gb == pytest.approx(1831055 * 16384 / GB)
    assert sample.swap_used_gb == pytest.approx(1117.25 * 1024 * 1024 / GB)
    assert sample.pressure == "warning"


def test_ventura_debug_limit_in_bytes_and_critical_pressure() -> None:
    sample = macos_sample(fixture("sysctl-m2pro-32g-ventura.txt"), fixture("vm_stat-m2pro-busy.txt"))
    assert sample.total_gb == pytest.approx(32 * GIB / GB)
    assert sample.wired_limit_gb == pytest.approx(24 * GIB / GB)
    assert sample.pressure == "critical"
    assert sample.swap_used_gb == pytest.approx(318.5 * 1024 * 1024 / GB)


def test_ventura_zero_debug_limit_means_the_default() -> None:
    sample = macos_sample(fixture("sysctl-m2pro-32g-ventura-default.txt"), fixture("vm_stat-m2pro-busy.txt"))
    assert sample.wired_limit_gb == pytest.approx(32 * GIB * 2 / 3 / GB, rel=1e-6)


def test_parsers_ignore_unknown_oid_lines_and_reject_garbage() -> None:
    values = parse_sysctl("sysctl: unknown oid 'debug.iogpu.wired_limit'\nhw.memsize: 42\n")
    assert values == {"hw.memsize": "42"}
    assert parse_swapusage("total = 1.00G  used = 512.00M  free = 512.00M") == pytest.approx(0.536870912)
    assert parse_vm_stat(fixture("vm_stat-m5max-idle.txt"))["Pages wired down"] == 198765
    with pytest.raises(ProbeError):
        parse_vm_stat("not vm_stat")
    with pytest.raises(ProbeError):
        macos_sample("kern.memorystatus_vm_pressure_level: 1", fixture("vm_stat-m5max-idle.txt"))


class CountingProbe:
    """Recorded figures, counting how often they are read."""

    name = "counting"

    def __init__(self) -> None:
        self.reads = 0

    async def sample(self) -> MemorySample:
        self.reads += 1
        await asyncio.sleep(0.01)
        return MemorySample(total_gb=64, wired_limit_gb=48, pinned_gb=float(self.reads))


def test_a_shared_probe_takes_one_sample_for_every_heartbeat_of_a_mac() -> None:
    async def run() -> tuple[list[MemorySample], MemorySample, int]:
        probe = CountingProbe()
        shared = SharedProbe(probe, max_age=0.2)
        together = await asyncio.gather(*(shared.sample() for _ in range(4)))  # four models' heartbeats
        await asyncio.sleep(0.25)
        return together, await shared.sample(), probe.reads

    together, later, reads = asyncio.run(run())
    assert {s.pinned_gb for s in together} == {1.0} and later.pinned_gb == 2.0 and reads == 2
