"""How many slots a supervised llama-server gets when the operator does not say: what fits the Mac.

Each slot holds one request of up to ``--ctx-per-slot`` tokens (the context the operator expects a request
to need: 32K by default, a coding agent's turn). llama-server allocates every slot's KV cache for its whole
context when it starts, so the slot count is a start-up memory question: ``(wired limit - weights -
headroom) / (KV bytes per token x context per slot)``, from the GGUF's attention shape, bounded by the
calibrated cap (more slots than the Mac serves well only hold memory) and by ``MAX_SLOTS``. A context above
the model's training context is cut to it, as llama-server cuts each slot's. A Mac that cannot hold one
request at that context is told so, with what to change (:func:`cannot_hold`).

llama-server's prompt cache in host memory (``--cache-ram``, 8 GiB by default) is sized too
(:func:`prompt_cache`): it is ordinary memory, outside what the GPU holds, and it is where an idle session's
history survives when its slot goes to another; the Mac's RAM less llama-server's weights, KV cache and
headroom, less what macOS and the other programs keep (``--host-reserve-gb``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from .memory import GB, MIB

DEFAULT_SLOTS = 4  # when memory cannot be sized (no GGUF shape, no wired limit)
MAX_SLOTS = 32
SHRINK = 0.75  # after persistent memory pressure, restart with a quarter fewer slots
CONTEXT_STEP = 1024  # a smaller context suggested to a Mac that cannot hold one request is a multiple of this


@dataclass(frozen=True)
class Sizing:
    """The slot count llama-server runs with, and why."""

    parallel: int
    ctx_per_slot: int
    chosen_by: str  # "operator" (--parallel), "memory", "calibrated", "default" or "pressure"
    reason: str
    fits: int | None = None  # slots the memory budget holds (None: not sized)
    budget_gb: float | None = None
    per_slot_gb: float | None = None
    cache_ram_mib: int | None = None  # --cache-ram the agent passes (None: the operator's, or llama-server's)
    cache_ram: str = ""  # why

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def context(ctx_per_slot: int, n_ctx_train: int | None) -> tuple[int, str]:
    """The context a slot gets: ``ctx_per_slot``, or the model's training context when that is smaller
    (llama-server gives a slot no more), and how to say it."""
    if n_ctx_train and n_ctx_train < ctx_per_slot:
        said = f"{n_ctx_train} tokens (the model's training context; --ctx-per-slot {ctx_per_slot})"
        return n_ctx_train, said
    return ctx_per_slot, f"{ctx_per_slot} tokens"


def choose(
    *,
    parallel: int | None,
    ctx_per_slot: int,
    wired_limit_gb: float | None,
    weights_gb: float | None,
    headroom_gb: float,
    kv_bytes_per_token: int | None,
    calibrated_cap: int | None,
    n_ctx_train: int | None = None,
) -> Sizing:
    """The operator's ``--parallel`` when given, else the slots that fit, bounded by the calibrated cap.
    Either way ``fits`` says how many slots the memory holds when it can be sized."""
    ctx, tokens = context(ctx_per_slot, n_ctx_train)
    if wired_limit_gb is None or not kv_bytes_per_token:
        missing = "no wired limit" if wired_limit_gb is None else "no KV shape in the model file"
        if parallel is not None:
            return Sizing(parallel, ctx, "operator", f"{parallel} slots x {tokens} (--parallel)")
        slots = max(1, min(DEFAULT_SLOTS, calibrated_cap or DEFAULT_SLOTS))
        return Sizing(slots, ctx, "default", f"{slots} slots x {tokens}: {missing} to size memory by")
    per_slot = kv_bytes_per_token * ctx / GB
    budget = wired_limit_gb - (weights_gb or 0.0) - headroom_gb
    fits = max(0, math.floor(budget / per_slot + 1e-9))
    figures = (fits, round(budget, 3), round(per_slot, 4))
    if parallel is not None:
        return Sizing(parallel, ctx, "operator", f"{parallel} slots x {tokens} (--parallel; {fits} fit)",
                      *figures)
    slots, chosen_by = min(fits, MAX_SLOTS), "memory"
    said = f"{fits} fit (wired limit {wired_limit_gb:.1f} GB - weights {weights_gb or 0.0:.1f} GB - " \
           f"headroom {headroom_gb:.1f} GB, {per_slot:.2f} GB a slot)"
    if calibrated_cap is not None and calibrated_cap < slots:
        slots, chosen_by = calibrated_cap, "calibrated"
        said += f", calibrated cap {calibrated_cap}"
    elif fits > MAX_SLOTS:
        said += f", at most {MAX_SLOTS}"
    if slots < 1:
        slots = 1
        said += "; not even one slot fits"
    return Sizing(slots, ctx, chosen_by, f"{slots} slots x {tokens}: {said}", *figures)


def cannot_hold(sizing: Sizing, weights_gb: float | None, headroom_gb: float, wired_limit_gb: float,
                kv_bytes_per_token: int) -> str | None:
    """One line for a Mac whose memory cannot hold one request at the context asked for, saying what to
    change; None when it can (or memory was not sized)."""
    if sizing.fits is None or sizing.fits >= 1 or sizing.budget_gb is None or sizing.per_slot_gb is None:
        return None
    weights = weights_gb or 0.0
    need_gb = weights + headroom_gb + sizing.per_slot_gb
    limit_mb = math.ceil(need_gb * GB / MIB)
    largest = math.floor(max(0.0, sizing.budget_gb) * GB / kv_bytes_per_token / CONTEXT_STEP) * CONTEXT_STEP
    smaller = (f"a smaller --ctx-per-slot ({largest} fits)" if largest >= CONTEXT_STEP
               else "a smaller --ctx-per-slot (none fits beside these weights)")
    return (
        f"this Mac cannot hold one request of {sizing.ctx_per_slot} tokens: its KV cache takes "
        f"{sizing.per_slot_gb:.2f} GB, and the wired limit {wired_limit_gb:.1f} GB - weights "
        f"{weights:.1f} GB - headroom {headroom_gb:.1f} GB leaves {sizing.budget_gb:.2f} GB. Change one: "
        f"{smaller}, a smaller model or quantization, or more wired memory (at least {need_gb:.1f} GB: "
        f"sudo sysctl iogpu.wired_limit_mb={limit_mb})"
    )


def shrunk(sizing: Sizing, beats: int) -> Sizing | None:
    """A quarter fewer slots after ``beats`` heartbeats of memory pressure; None when already at one."""
    slots = min(sizing.parallel - 1, math.floor(sizing.parallel * SHRINK))
    if slots < 1:
        return None
    reason = (f"{slots} slots x {sizing.ctx_per_slot} tokens: memory pressure for {beats} heartbeats "
              f"with {sizing.parallel}")
    # the prompt cache stays: fewer slots only leave it more room
    return replace(sizing, parallel=slots, chosen_by="pressure", reason=reason)


CACHE_RAM_FLAGS = frozenset({"-cram", "--cache-ram"})
CACHE_RAM_ENV = "LLAMA_ARG_CACHE_RAM"


def operator_cache_ram(llama_args: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """How the operator set llama-server's prompt cache (``-- --cache-ram N`` or ``LLAMA_ARG_CACHE_RAM``),
    which the agent never overrides; None when they did not."""
    for arg in llama_args:
        if arg.partition("=")[0] in CACHE_RAM_FLAGS:
            return arg.partition("=")[0]
    return CACHE_RAM_ENV if environ.get(CACHE_RAM_ENV) else None


def prompt_cache(sizing: Sizing, *, total_gb: float, weights_gb: float, kv_bytes_per_token: int,
                 headroom_gb: float, reserve_gb: float) -> Sizing:
    """``sizing`` with the ``--cache-ram`` its llama-server gets (:func:`cache_ram`), its KV cache that of
    every slot at its context."""
    kv_gb = kv_bytes_per_token * sizing.parallel * sizing.ctx_per_slot / GB
    mib, said = cache_ram(total_gb=total_gb, weights_gb=weights_gb, kv_gb=kv_gb, headroom_gb=headroom_gb,
                          reserve_gb=reserve_gb)
    return replace(sizing, cache_ram_mib=mib, cache_ram=said)


def cache_ram(*, total_gb: float, weights_gb: float, kv_gb: float, headroom_gb: float,
              reserve_gb: float) -> tuple[int, str]:
    """The Mac's RAM less the weights, the KV cache, the headroom and the host reserve, in MiB (0, no
    prompt cache, when nothing is left), and how to say it. It may be less than llama-server's default
    8 GiB: on a Mac with no more to spare, that default would page."""
    spare = total_gb - weights_gb - kv_gb - headroom_gb - reserve_gb
    mib = max(0, math.floor(spare * GB / MIB))
    said = (f"{mib} MiB (RAM {total_gb:.1f} GB - weights {weights_gb:.1f} GB - KV cache {kv_gb:.1f} GB - "
            f"headroom {headroom_gb:.1f} GB - host reserve {reserve_gb:.1f} GB)")
    if mib == 0:
        said += ": no memory to spare for it"
    return mib, said
