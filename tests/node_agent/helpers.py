"""Helpers for the agent's tests: poll, read node documents from Redis, read the simulator's figures."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import uvloop
from gguf import GGUFWriter

from macpool.contract import NodeDoc
from macpool.store import Keys
from tests.conftest import Server
from tests.conftest import wait_until as wait_until

INTERVAL = "0.3"  # fast heartbeats keep the tests short
SIM_COMMAND = f"{sys.executable} -m macpool.cli sim --preset m5max-128g-14b-q4 --speed 20"
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {  # the agent runs on uvloop when installed
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}





# llama-server's answers, recorded (fixtures/llama-server/README.md)
RECORDED = Path(__file__).resolve().parent / "fixtures" / "llama-server"


def recorded_body(name: str) -> str:
    """The body of a recorded answer (the file holds its status line and headers first)."""
    return (RECORDED / name).read_text().split("\n\n", 1)[1]


def read_node(redis_url: str, node_id: str) -> NodeDoc | None:
    client = redis.Redis.from_url(redis_url)
    try:
        raw = client.hget(Keys().node(node_id), "doc")
    finally:
        client.close()
    return NodeDoc.decode(raw) if raw else None


def node_ttl_ms(redis_url: str, node_id: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.pttl(Keys().node(node_id)))
    finally:
        client.close()


def sim_stats(url: str) -> dict[str, Any]:
    import httpx

    data: dict[str, Any] = httpx.get(url + "/sim/stats", timeout=5).json()
    return data


def status(url: str) -> dict[str, Any]:
    import httpx

    data: dict[str, Any] = json.loads(httpx.get(url + "/status", timeout=5).text)
    return data


AgentFactory = Callable[..., Server]


def write_gguf(
    path: Path, layers: int, heads: int, kv_heads: int, embd: int, key_length: int | None = None,
    context: int = 4096,
) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_embedding_length(embd)
    writer.add_context_length(context)
    if key_length:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    writer.add_tensor("token_embd.weight", np.zeros((8, embd), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
