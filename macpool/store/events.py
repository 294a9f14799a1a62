"""The messages of the pool's events channel (``Keys.events``), as the scripts and Store.drain send them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from macpool.contract import NodeDoc


@dataclass(frozen=True)
class Heartbeat:
    """``node <doc json>``: an agent's heartbeat."""

    doc: NodeDoc


@dataclass(frozen=True)
class Gone:
    """``gone <node>``: an agent shut down cleanly."""

    node_id: str


@dataclass(frozen=True)
class Freed:
    """``freed <node>``: one slot was released there and handed to nobody."""

    node_id: str


@dataclass(frozen=True)
class Granted:
    """``granted <request> <node> <k>``: a release handed k slots on a node straight to a queued request."""

    request_id: str
    node_id: str
    slots: int


@dataclass(frozen=True)
class Shed:
    """``shed <request>``: a queued batch request lost its place to an interactive one."""

    request_id: str


@dataclass(frozen=True)
class Drained:
    """``drain <node>`` / ``undrain <node>``: an operator drained a node, or took it back."""

    node_id: str
    drained: bool


@dataclass(frozen=True)
class Autoscaled:
    """``autoscale <decision json>``: a decision of ``macpool autoscale`` (autoscale/controller.py)."""

    decision: dict[str, Any]


Event = Heartbeat | Gone | Freed | Granted | Shed | Drained | Autoscaled


def autoscale_message(decision: dict[str, Any]) -> str:
    return f"autoscale {json.dumps(decision, separators=(',', ':'))}"


def drain_message(node_id: str, drained: bool) -> str:
    return f"{'drain' if drained else 'undrain'} {node_id}"


def parse_event(message: str) -> Event | None:
    """One message of the channel; None for one this version does not know, or cannot read."""
    kind, _, rest = message.partition(" ")
    if kind == "node":
        try:
            return Heartbeat(NodeDoc.decode(rest))
        except ValidationError:
            return None
    if kind == "granted":
        request_id, node_id, slots = [*rest.split(" ", 2), "", ""][:3]
        return Granted(request_id, node_id, int(slots)) if slots.isdigit() else None
    if kind == "gone":
        return Gone(rest)
    if kind == "freed":
        return Freed(rest)
    if kind == "shed":
        return Shed(rest)
    if kind in ("drain", "undrain"):
        return Drained(rest, kind == "drain")
    if kind == "autoscale":
        try:
            decision = json.loads(rest)
        except ValueError:
            return None
        return Autoscaled(decision) if isinstance(decision, dict) else None
    return None
