"""What routers and node agents agree on besides Redis: the heartbeat document, what a request costs a node.

The Redis side of the contract - key names, the scripts and the typed calls - is :mod:`macpool.store`.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, computed_field

NodeState = Literal[
    "starting", "ready", "draining", "unhealthy", "paging",
    # the elastic pool (node_agent/standby.py): registered with its model not loaded, loading it on the
    # controller's word, finishing its requests before going back to standby; "asleep" and "waking" are
    # the autoscaler's records of a Mac whose agent does not beat (macpool/autoscale/controller.py)
    "standby", "loading", "draining-to-standby", "asleep", "waking",
    # a model the pool declared (``macpool models add``) that this Mac took and is downloading from the hub
    # (node_agent/pool_models.py): in standby once it is on the Mac and verified
    "downloading",
]
NODE_STATES: tuple[NodeState, ...] = get_args(NodeState)  # every state, for metrics that show each one
MemoryState = Literal["healthy", "near_ceiling", "paging", "collapsed"]
Priority = Literal["interactive", "batch"]


# a model's name on a Mac of several (--models) or in the pool's declarations (`macpool models`): its
# llama-server model id, and part of its node id and URL
MODEL_NAME = re.compile(r"^[A-Za-z0-9][\w.:-]*$")


def now_ms() -> int:
    return int(time.time() * 1000)


class MemoryFigures(BaseModel):
    """Unified-memory figures of one Mac, in GB (10**9 bytes)."""

    total_gb: float = 0.0
    wired_limit_gb: float = 0.0
    weights_gb: float = 0.0
    pinned_gb: float = 0.0
    per_request_gb: float = 0.0
    swap_used_gb: float = 0.0
    pressure: Literal["normal", "warning", "critical"] = "normal"
    state: MemoryState = "healthy"


class CapacityBreakdown(BaseModel):
    """Each term of ``capacity = min(configured, memory, calibrated)`` (None: no such limit)."""

    configured: int | None = None
    memory: int | None = None
    calibrated: int | None = None
    pressure_limited: bool = False


LoadCost = Literal["free", "evict", "full"]
LOAD_COST_ORDER: dict[str, int] = {"free": 0, "evict": 1, "full": 2}


class Download(BaseModel):
    """How far a model's download from the hub is: bytes over all its files."""

    done_bytes: int = 0
    total_bytes: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def percent(self) -> float:
        return round(100.0 * self.done_bytes / self.total_bytes, 1) if self.total_bytes else 0.0


class ModelState(BaseModel):
    """What a node says of one model it serves, or would serve once loaded (``NodeDoc.model_states``)."""

    name: str
    state: Literal["loaded", "loading", "loadable", "downloading"]
    capacity: int = 0  # requests it takes at once, when loaded
    in_flight: int = 0
    # what it holds loaded, in GB (10**9 bytes): weights and the KV cache of every slot (None: not known)
    memory_gb: float | None = None
    load_s: float | None = None  # how long its last load took on this node (None: not seen yet)
    download: Download | None = None  # while it downloads: how far


class NodeDoc(BaseModel):
    """The heartbeat document an agent writes for its Mac every interval."""

    node_id: str
    url: str  # how routers reach the agent's gateway
    models: list[str] = Field(default_factory=list)
    capacity: int = 0
    in_flight: int = 0
    total_slots: int = 0
    state: NodeState = "starting"
    reason: str = ""  # why the state/capacity is what it is, for operators
    memory: MemoryFigures = Field(default_factory=MemoryFigures)
    capacity_breakdown: CapacityBreakdown = Field(default_factory=CapacityBreakdown)
    tokens_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    # decode speed of one slot, from the streamed answers (smoothed), and the requests in flight meanwhile:
    # a router scales it to the concurrency a new request would meet (router/placement.py)
    slot_tokens_per_s: float | None = None
    slot_concurrency: float | None = None
    # prompt-processing speed, tokens/s (smoothed): what a request's prefill costs on this node
    prefill_tokens_per_s: float | None = None
    # ... measured on tokens this deep in their prompts, on average (a deeper token costs more)
    prefill_depth: float | None = None
    ctx_per_slot: int = 0
    # llama-server's KV cache, as admission counts it in tokens (0 / -1: unknown, and then only slots count):
    # the most tokens (prompt + output) one request may hold - its context per sequence, the whole context
    # when the slots share one pool of cells (kv_unified); the cells of its cache in all, and those it holds
    # now (for the dashboard); and its output limit for a request that sets none (-1: none)
    seq_ctx: int = 0
    kv_unified: bool = False
    kv_cells: int = 0
    kv_cells_used: int = 0
    n_predict: int = -1
    sizing: str = ""  # supervise mode: the slots llama-server runs with, and why
    llama_build: str = ""
    agent_version: str = ""
    started_at_ms: int = 0
    updated_at_ms: int = 0
    instance: str = ""  # this agent process (random, per start): two agents under one id are told apart
    elastic: bool = False  # follows the autoscaler's active/standby word (agent --elastic or --standby)
    standby_capacity: int = 0  # the capacity it has once loaded (elastic nodes)
    wol_mac: str = ""  # how the autoscaler wakes this Mac from sleep ("": it cannot)
    wol_broadcast: str = ""
    model_states: list[ModelState] = Field(default_factory=list)  # per model, loaded or loadable
    # what loading its model would cost the Mac now (a standby node): "free" memory, "evict" idle models of
    # the same Mac first, or "full" (the memory is held by models with requests in flight: no load now)
    load_cost: LoadCost = "free"
    # who vouches for this document (macpool/identity.py): the pool-issued credential that signed it - its
    # node id (this node's, or the Mac's for a model node "<mac>/<model>") and when it was issued (ms) - and
    # the signature of its SIGNED_FIELDS ("": unsigned)
    signer: str = ""
    signer_issued_ms: int = 0
    signature: str = ""

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | bytes) -> NodeDoc:
        return cls.model_validate_json(raw)


class DeclaredModel(BaseModel):
    """A model the pool serves (``macpool models add``): the agents started with ``--from-pool`` take it,
    ``replicas`` Macs at most, each one whose memory budget holds it (macpool/store/models.py)."""

    name: str
    ref: str  # a Hugging Face reference (org/repo:QUANT, org/repo/file.gguf), or a GGUF path every Mac has
    replicas: int = Field(default=1, ge=1)
    removing: bool = False  # `macpool models rm`: drained, then unloaded, then forgotten
    added_at_ms: int = 0

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | bytes) -> DeclaredModel:
        return cls.model_validate_json(raw)
# what a signature covers: who the node is, where routers reach it, which process, when, and every figure
# placement, admission and the autoscaler act on. The rest (memory figures, reasons, versions) is for people
# to read and can be altered by whoever writes Redis without moving a request.
SIGNED_FIELDS: tuple[str, ...] = (
    "node_id", "url", "instance", "started_at_ms", "updated_at_ms", "signer", "signer_issued_ms", "state",
    "models", "capacity", "total_slots", "tokens_per_s", "ttft_p50_ms", "slot_tokens_per_s",
    "slot_concurrency", "prefill_tokens_per_s", "prefill_depth", "ctx_per_slot", "seq_ctx", "kv_unified",
    "kv_cells", "n_predict", "elastic", "standby_capacity", "wol_mac", "wol_broadcast", "load_cost",
)


def signed_payload(doc: NodeDoc) -> bytes:
    """The bytes a heartbeat's signature covers: its SIGNED_FIELDS as canonical JSON (sorted keys, no
    spaces), computed alike by the agent from its document and by a router from the JSON it read."""
    fields = doc.model_dump(mode="json", include=set(SIGNED_FIELDS))
    return b"macpool heartbeat 1\n" + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def heartbeat_ttl_ms(interval_s: float) -> int:
    """A node key lives about three heartbeat intervals."""
    return max(int(interval_s * 3000), 1000)


# --- What a request costs a node ------------------------------------------------------------------

def generations(payload: dict[str, Any]) -> int:
    """How many generations llama-server runs for one request: one per prompt of a list of prompts, times
    ``n_cmpl`` (or its alias ``n``); each takes a slot, and its memory, while it runs. A value llama-server
    would refuse counts 1 (its own 400 answers the request)."""
    n = payload.get("n_cmpl")
    if n is None:  # absent or null: llama-server reads n
        n = payload.get("n")
    if type(n) is float and math.isfinite(n):
        n = int(n)  # llama-server reads a JSON number as an integer: 2.5 runs 2
    return _prompts(payload.get("prompt")) * (n if type(n) is int and n > 1 else 1)


def _prompts(prompt: object) -> int:
    """The prompts in a request's ``prompt``: a list of them, unless it is one prompt - token ids, or strings
    and token ids mixed (llama-server tokenizes the strings in place)."""
    if not isinstance(prompt, list) or any(type(token) is int for token in prompt):
        return 1
    return len(prompt) or 1


def slots_needed(generations: int, total_slots: int) -> int:
    """The slots a request of ``generations`` holds at once on a llama-server of ``total_slots`` (0: unknown):
    past its slots, llama-server queues the rest of a request's generations."""
    return min(generations, total_slots) if total_slots > 0 else generations
