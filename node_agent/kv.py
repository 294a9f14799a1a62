"""llama-server's KV cache as admission counts it: the tokens one request may hold, whether the slots share
one pool of cells, how many cells there are, and the output limit of a request that sets none.

Its HTTP surface tells part of it: ``/props`` gives the slots (``total_slots``) and the context one sequence
may hold (``default_generation_settings.n_ctx``: llama-server's ``n_ctx_slot()``, already capped by
``--kv-unified-per-slot`` and the model's training context), ``/slots`` what each slot holds now, and
``/v1/models`` the training context. The rest is in its arguments alone: whether the slots share one pool
(``--kv-unified``, and always when ``--parallel`` is left at auto), the pool's size when a sequence's context
is capped below it, and ``-n`` (``/props`` shows ``n_predict`` -1 whatever ``-n`` says). A split cache of 4
slots of 16K and a shared one of 16K answer ``/props`` alike. So the arguments are read from:

- supervise mode: the command line the agent started llama-server with (and the agent's environment, which
  llama-server inherits);
- attach mode: the command line and ``LLAMA_ARG_*`` environment of the process listening on the upstream's
  port, when it runs on this machine and agrees with ``/props`` on the slot count; else the arguments after
  ``--`` (``llama_args``), which describe an llama-server the agent cannot see; else none: llama-server's
  defaults, whose slots share one pool of as many cells as one sequence may hold. Those are also the fewest
  cells any cache answering that ``/props`` can have (a split one only holds more), so a router counting
  them never admits past the real cache.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import psutil

PAD = 256  # llama.cpp rounds the context, and each sequence's share of a split one, up to this many cells
AUTO_SLOTS = 4  # --parallel left at auto: 4 slots over one unified cache (tools/server/server.cpp)

# the flags and LLAMA_ARG_* variables that shape the cache (common/arg.cpp); a flag beats its variable
INT_FLAGS: dict[str, str] = {
    "-np": "parallel", "--parallel": "parallel", "-c": "ctx_size", "--ctx-size": "ctx_size",
    "--kv-unified-per-slot": "per_slot",
    "-n": "n_predict", "--predict": "n_predict", "--n-predict": "n_predict",
}
UNIFIED_FLAGS: dict[str, bool] = {
    "-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False,
}
INT_ENV: dict[str, str] = {
    "LLAMA_ARG_N_PARALLEL": "parallel", "LLAMA_ARG_CTX_SIZE": "ctx_size",
    "LLAMA_ARG_KV_UNIFIED_PER_SLOT": "per_slot", "LLAMA_ARG_N_PREDICT": "n_predict",
}
UNIFIED_ENV = "LLAMA_ARG_KV_UNIFIED"
TRUTHY, FALSEY = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")


@dataclass(frozen=True)
class LlamaArgs:
    """What llama-server's arguments say of its KV cache."""

    parallel: int = -1  # -1: auto
    kv_unified: bool = False  # as given: --parallel at auto makes the cache unified whatever this says
    ctx_size: int | None = None  # None: not given; 0: the model's training context, asked for
    per_slot: int = 0  # --kv-unified-per-slot (0: unset)
    n_predict: int = -1

    @property
    def unified(self) -> bool:
        return self.parallel < 0 or self.kv_unified

    @property
    def slots(self) -> int:
        return AUTO_SLOTS if self.parallel < 0 else self.parallel


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LlamaArgs:
    """The cache-shaping arguments of an llama-server command line (its program name left out) run with
    ``environ``. Values llama-server would refuse are skipped: it would not have started."""
    values: dict[str, int | bool] = {}
    env = environ or {}
    for name, key in INT_ENV.items():
        number = _int(env.get(name))
        if number is not None:
            values[key] = number
    if env.get(UNIFIED_ENV) in TRUTHY + FALSEY:
        values["kv_unified"] = env[UNIFIED_ENV] in TRUTHY
    args = list(argv)
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            arg = arg.replace("_", "-")  # llama-server reads --ctx_size as --ctx-size
        if arg in UNIFIED_FLAGS:
            values["kv_unified"] = UNIFIED_FLAGS[arg]
        elif arg in INT_FLAGS and i + 1 < len(args):
            number = _int(args[i + 1])
            if number is not None:
                values[INT_FLAGS[arg]] = number
    return LlamaArgs(**values)  # type: ignore[arg-type]


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _pad(cells: int) -> int:
    return -(-cells // PAD) * PAD


@dataclass(frozen=True)
class KvCache:
    """llama-server's KV cache in tokens, as ``NodeDoc`` carries it."""

    seq_ctx: int  # the most tokens, prompt and output, one request may hold
    unified: bool  # the slots share one pool of cells
    cells: int  # cells in all
    n_predict: int  # the output limit of a request that sets none (-1: none)

    def describe(self, slots: int) -> str:
        if self.unified:
            return (f"{slots} slots sharing one KV cache of {self.cells} cells, at most {self.seq_ctx} "
                    "tokens a request")
        return f"{slots} slots of {self.seq_ctx} tokens, each its own KV cells ({self.cells} in all)"


def layout(args: LlamaArgs, slots: int, n_ctx_slot: int, n_ctx_train: int = 0) -> KvCache:
    """The cache llama-server built from ``args``, given what ``/props`` says: ``slots`` and ``n_ctx_slot``
    (the most one sequence holds: exact, whatever the arguments), and the training context (0: unknown)."""
    context = _context(args, slots, n_ctx_train)
    if args.unified:
        # unset, the context is the training one or less (to fit memory): then one sequence holds all of it
        cells = context or n_ctx_slot
    else:
        cells = (_pad(context // slots) if context else n_ctx_slot) * slots
    return KvCache(n_ctx_slot, args.unified, max(cells, n_ctx_slot), args.n_predict)


def _context(args: LlamaArgs, slots: int, n_ctx_train: int) -> int | None:
    """llama.cpp's whole context as the arguments fix it; None when they leave it to the model and memory."""
    ctx = args.ctx_size
    if ctx is None and args.per_slot > 0:
        ctx = slots * args.per_slot  # the pool sized to the slots (not with an explicit -c 0)
    if ctx == 0:
        ctx = n_ctx_train  # asked for in full: never reduced to fit memory
    return _pad(ctx) if ctx else None


# --- where the arguments come from ----------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """llama-server's arguments, and where they were read (for ``/status`` and the log)."""

    args: LlamaArgs
    said: str
    known: bool = True  # False: llama-server's defaults, taken for want of its arguments

    def as_dict(self) -> dict[str, object]:
        return {"from": self.said, "args": asdict(self.args)}


@dataclass(frozen=True)
class Listener:
    """The process listening on an upstream's port on this machine."""

    pid: int
    argv: list[str]
    environ: dict[str, str]


def supervised(argv: Sequence[str]) -> Source:
    """The llama-server the agent started: its own command line, in the agent's environment."""
    return Source(parse_args(argv[1:], os.environ), "the command line the agent started it with")


def attached(url: str, declared: Sequence[str], slots: int) -> Source:
    """The arguments of the llama-server at ``url`` that answers ``/props`` with ``slots`` (blocking: it
    looks through this machine's processes)."""
    try:
        seen = listener(url)
    except (psutil.Error, OSError) as exc:  # a process gone, or a table unreadable, as it was read
        seen = f"its process could not be looked up ({type(exc).__name__}: {exc})"
    if isinstance(seen, Listener):
        args = parse_args(seen.argv[1:], seen.environ)
        if seen.pid == os.getpid():  # a server in this very process (tests): no llama-server's command line
            why = "it is served from the agent's own process"
        elif args.slots != slots:
            why = (f"the process listening on its port (pid {seen.pid}) runs {args.slots} slots, /props "
                   f"says {slots}")
        else:
            return Source(args, f"its command line (pid {seen.pid})")
    else:
        why = seen
    if declared:
        args = parse_args(declared)
        if args.slots == slots:
            return Source(args, f"the arguments after -- ({why})")
        why += f"; the arguments after -- give {args.slots} slots, /props says {slots}"
    return Source(LlamaArgs(), f"llama-server's defaults ({why})", known=False)


async def attached_async(url: str, declared: Sequence[str], slots: int) -> Source:
    return await asyncio.to_thread(attached, url, declared, slots)


def listener(url: str) -> Listener | str:
    """The process listening on ``url``'s port, when ``url`` names this machine; else why not."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError as exc:
        return f"{host} does not resolve ({exc})"
    local = {address.address.split("%")[0] for nic in psutil.net_if_addrs().values() for address in nic}
    if not addresses & local:
        return f"{host} is not this machine"
    pid = _listening_pid(port, addresses | {"0.0.0.0", "::"})
    if pid is None:
        return f"no process of this user is seen listening on port {port}"
    try:
        process = psutil.Process(pid)
        argv = process.cmdline()
    except psutil.Error as exc:
        return f"the command line of pid {pid} is not readable ({type(exc).__name__})"
    try:
        environ = process.environ()
    except psutil.Error:
        environ = {}  # (macOS shows other processes' environments to root alone: the flags still count)
    return Listener(pid, argv, environ)


def _listening_pid(port: int, addresses: set[str]) -> int | None:
    def listens(conn: Any) -> bool:
        return (conn.status == psutil.CONN_LISTEN and bool(conn.laddr) and conn.laddr.port == port
                and conn.laddr.ip in addresses)

    try:  # every process's sockets at once (Linux; on macOS only root may)
        connections = psutil.net_connections("tcp")
    except psutil.AccessDenied:
        connections = None
    if connections is not None:
        return next((conn.pid for conn in connections if listens(conn) and conn.pid), None)
    for process in psutil.process_iter():  # one process at a time: this user's are readable
        try:
            if any(listens(conn) for conn in process.net_connections("tcp")):
                return process.pid
        except psutil.Error:
            continue
    return None
