"""Memory probes behind one interface: macOS (sysctl, vm_stat), Linux (psutil), the simulator (/sim/memory).

All figures are GB of 10**9 bytes, as in :class:`macpool.contract.MemoryFigures`.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx
import psutil

from macpool.contract import MemoryState

GB = 1e9
MIB = 1024 * 1024
Pressure = Literal["normal", "warning", "critical"]

# kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical (xnu's kVMPressure* levels)
_PRESSURE_LEVELS: dict[int, Pressure] = {1: "normal", 2: "warning", 4: "critical"}
_SIZE = re.compile(r"([\d.]+)([KMGT]?)")
_UNITS = {"": 1, "K": 1024, "M": MIB, "G": 1024**3, "T": 1024**4}


class ProbeError(RuntimeError):
    """A probe could not read the machine's memory figures."""


class UpstreamUnreachable(ProbeError):
    """The upstream did not answer at all, so whether it is a simulator is still unknown."""


@dataclass
class MemorySample:
    """One reading of the machine's memory."""

    total_gb: float
    wired_limit_gb: float
    pinned_gb: float
    swap_used_gb: float = 0.0
    pressure: Pressure = "normal"
    external_gb: float = 0.0  # memory another app took from the pool (the simulator reports it)
    weights_gb: float | None = None  # the probe's own figures, when it knows them (the simulator)
    per_request_gb: float | None = None
    state: MemoryState | None = None


class MemoryProbe(Protocol):
    name: str

    async def sample(self) -> MemorySample: ...


# --- macOS ---------------------------------------------------------------------------------------------


def default_wired_limit_bytes(total_bytes: int) -> int:
    """The GPU wired limit when ``iogpu.wired_limit_mb`` is 0: ~2/3 of RAM up to 36 GB, 3/4 above."""
    fraction = 2 / 3 if total_bytes <= 36 * 1024**3 else 3 / 4
    return int(total_bytes * fraction)


def parse_sysctl(text: str) -> dict[str, str]:
    """``sysctl name1 name2 ...`` output (``name: value`` lines); unknown names are simply absent."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and not name.startswith("sysctl") and " " not in name.strip():
            values[name.strip()] = value.strip()
    return values


def parse_swapusage(value: str) -> float:
    """``total = 2048.00M  used = 1117.25M  free = 930.75M  (encrypted)`` -> used, in GB."""
    match = re.search(r"used\s*=\s*([\d.]+[KMGT]?)", value)
    if not match:
        raise ProbeError(f"vm.swapusage: cannot parse {value!r}")
    return _size_bytes(match.group(1)) / GB


def _size_bytes(text: str) -> float:
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ProbeError(f"cannot parse size {text!r}")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_vm_stat(text: str) -> dict[str, int]:
    """``vm_stat`` output -> {"page size": bytes, "Pages wired down": pages, ...}."""
    values: dict[str, int] = {}
    header = re.search(r"page size of (\d+) bytes", text)
    if not header:
        raise ProbeError("vm_stat: no page size in the header")
    values["page size"] = int(header.group(1))
    for line in text.splitlines()[1:]:
        name, sep, value = line.partition(":")
        number = value.strip().rstrip(".")
        if sep and number.isdigit():
            values[name.strip().strip('"')] = int(number)
    return values


def macos_sample(sysctl_text: str, vm_stat_text: str) -> MemorySample:
    """Turn recorded ``sysctl`` and ``vm_stat`` output into one sample."""
    ctl = parse_sysctl(sysctl_text)
    if "hw.memsize" not in ctl:
        raise ProbeError("sysctl: no hw.memsize")
    total = int(ctl["hw.memsize"])
    limit = 0
    if int(ctl.get("iogpu.wired_limit_mb", "0") or 0) > 0:  # macOS 14+
        limit = int(ctl["iogpu.wired_limit_mb"]) * MIB
    elif int(ctl.get("debug.iogpu.wired_limit", "0") or 0) > 0:  # macOS 13, in bytes
        limit = int(ctl["debug.iogpu.wired_limit"])
    if limit <= 0:
        limit = default_wired_limit_bytes(total)
    vm = parse_vm_stat(vm_stat_text)
    wired = vm.get("Pages wired down", 0) * vm["page size"]
    swap = parse_swapusage(ctl["vm.swapusage"]) if "vm.swapusage" in ctl else 0.0
    level = int(ctl.get("kern.memorystatus_vm_pressure_level", "1") or 1)
    return MemorySample(
        total_gb=total / GB,
        wired_limit_gb=limit / GB,
        pinned_gb=wired / GB,
        swap_used_gb=swap,
        pressure=_PRESSURE_LEVELS.get(level, "warning"),
    )


SYSCTL_NAMES = (
    "hw.memsize",
    "iogpu.wired_limit_mb",
    "debug.iogpu.wired_limit",
    "vm.swapusage",
    "kern.memorystatus_vm_pressure_level",
)


async def _run(argv: list[str]) -> str:
    """The command's output; killed if the caller stops waiting (a timeout): a hung sysctl must not linger."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
        )
    except OSError as exc:  # uvloop's error does not name the command
        raise ProbeError(f"{argv[0]}: {exc.strerror or exc}") from exc
    try:
        out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return out.decode(errors="replace")  # sysctl exits 1 on an unknown name but prints the rest


class MacProbe:
    name = "macos"

    async def sample(self) -> MemorySample:
        async with asyncio.timeout(5):
            sysctl_text, vm_text = await asyncio.gather(_run(["sysctl", *SYSCTL_NAMES]), _run(["vm_stat"]))
        return macos_sample(sysctl_text, vm_text)


# --- Linux (development machines, CI): no wired limit, so take macOS's default rule -----------------------


class LinuxProbe:
    name = "linux"

    async def sample(self) -> MemorySample:
        vm = psutil.virtual_memory()
        swap = psutil.swap_memory()
        free_fraction = vm.available / vm.total
        pressure: Pressure = (
            "critical" if free_fraction < 0.05 else "warning" if free_fraction < 0.10 else "normal"
        )
        return MemorySample(
            total_gb=vm.total / GB,
            wired_limit_gb=default_wired_limit_bytes(vm.total) / GB,
            pinned_gb=(vm.total - vm.available) / GB,
            swap_used_gb=swap.used / GB,
            pressure=pressure,
        )


# --- the simulator ----------------------------------------------------------------------------------------


class SimProbe:
    name = "sim"

    def __init__(self, client: httpx.AsyncClient, base_url: Callable[[], str]) -> None:
        self._client = client
        self._base_url = base_url

    async def sample(self) -> MemorySample:
        try:
            response = await self._client.get(self._base_url() + "/sim/memory", timeout=2.0)
            response.raise_for_status()
            data = response.json()
        except httpx.HTTPStatusError as exc:
            raise ProbeError(f"/sim/memory: HTTP {exc.response.status_code}") from exc
        except (httpx.HTTPError, ValueError) as exc:
            raise UpstreamUnreachable(f"/sim/memory: {type(exc).__name__}") from exc
        pressure = data.get("pressure", "normal")
        return MemorySample(
            total_gb=float(data["total_gb"]),
            wired_limit_gb=float(data["wired_limit_gb"]),
            pinned_gb=float(data["pinned_gb"]),
            swap_used_gb=float(data.get("swap_used_gb", 0.0)),
            pressure=pressure if pressure in ("normal", "warning", "critical") else "warning",
            external_gb=float(data.get("external_gb", 0.0)),
            # (a simulated Mac of several models says neither: each model's weights are its own)
            weights_gb=_figure(data.get("weights_gb")),
            per_request_gb=_figure(data.get("per_request_gb")),
            state=data.get("state"),
        )


def _figure(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


class AutoProbe:
    """The simulator's figures when the upstream has /sim/memory, else this platform's probe."""

    def __init__(self, client: httpx.AsyncClient, base_url: Callable[[], str]) -> None:
        self._sim = SimProbe(client, base_url)
        self._chosen: MemoryProbe | None = None
        self.name = "auto"

    async def sample(self) -> MemorySample:
        if self._chosen is not None:
            return await self._chosen.sample()
        try:
            sample = await self._sim.sample()
        except UpstreamUnreachable:
            return await platform_probe().sample()
        except ProbeError:
            platform = platform_probe()
            self._decide(platform)
            return await platform.sample()
        self._decide(self._sim)
        return sample

    def _decide(self, probe: MemoryProbe) -> None:
        self._chosen = probe
        self.name = probe.name


def platform_probe() -> MemoryProbe:
    return MacProbe() if sys.platform == "darwin" else LinuxProbe()


def make_probe(kind: str, client: httpx.AsyncClient, base_url: Callable[[], str]) -> MemoryProbe:
    probes: dict[str, Callable[[], MemoryProbe]] = {
        "auto": lambda: AutoProbe(client, base_url),
        "macos": MacProbe,
        "linux": LinuxProbe,
        "sim": lambda: SimProbe(client, base_url),
    }
    return probes[kind]()


class SharedProbe:
    """One probe read by several heartbeats (one per model of a Mac): a sample younger than ``max_age``
    seconds is shared rather than taken again, and concurrent reads wait for the one sample under way."""

    def __init__(self, probe: MemoryProbe, max_age: float) -> None:
        self._probe = probe
        self._max_age = max_age
        self._lock = asyncio.Lock()
        self._last: MemorySample | None = None
        self._taken = 0.0
        self.name = probe.name

    async def sample(self) -> MemorySample:
        async with self._lock:
            if self._last is None or time.monotonic() - self._taken > self._max_age:
                try:  # (an error is raised to this reader, not kept)
                    self._last = await self._probe.sample()
                finally:
                    self.name = self._probe.name  # "auto" names the probe it chose
                self._taken = time.monotonic()
            return self._last
