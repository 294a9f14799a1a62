"""Where a request goes among the nodes with room for it (``--placement``).

The choice is made in Redis, atomically with the reservation (macpool/store/reserve.lua); a strategy here only
says what the script weighs for each node:

- ``fastest``: the node that would answer soonest. A node's heartbeat carries its TTFT p50 and the decode
  speed of one slot (one over the median gap between tokens), measured on its streamed answers while about
  ``slot_concurrency`` requests ran there. Decode is memory-bound on a Mac: each step streams the weights
  once for the whole batch, and every sequence in the batch adds a little (the simulator presets'
  ``decode_t1_ms / decode_t0_ms``, docs/simulator.md), more the more context it holds, whose KV cache the
  step reads too (``batch_cost``: a coding agent's 30K-token sequence costs a step more than the weights
  do). So one slot's time per token is about ``t0 * (1 + batch_cost * b)`` with ``b`` requests running. A
  prompt is another matter: llama-server processes it in the steps that decode the others, and every stream
  on the node waits for it, about a first token's time. Each of the ``b`` requests processes its prompt
  about once while a new one runs (the new one's own is its first token), so the script expects ``b * ttft +
  tokens * t0 * (1 + batch_cost * b)`` seconds for a request that makes it ``b``. Where every node's prompt
  speed is known, the request's own prompt is added at that speed, brought to the depth its tokens sit at
  (``prompt_seconds``); the part a node's cache holds is taken off in the script, the rest costing more a
  token. The prompts ahead are then the router's backlog (``Leases.backlog_s``), at the Mac's whole speed
  (the agent measures it so), and take the place of ``b * ttft``, whose first tokens already waited on each
  other. A Mac whose prompts are slow (a slow GPU, long prompts) grows slow with every request it takes, as
  its measured curve does (docs/benchmarks.md, placement); a fast Mac takes requests while it is still the
  quicker answer even busy; identical Macs fill evenly. Until every node with room has been measured (a new
  Mac, a restart), the least-utilised one is chosen, so it gets measured.
- ``least-utilised``: the node with the smallest share of its capacity in use (ties: the faster node).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from macpool.contract import NodeDoc
from macpool.store import Candidate

Placement = Literal["fastest", "least-utilised"]
BATCH_COST = 0.175  # each request in a decode batch slows every slot's step by this share of a lone step
# ... and by as much again per this many tokens its sequence holds: a decode step reads every sequence's KV
# cache besides the weights, and a sequence this deep reads about as many bytes of it as the step reads of
# weights (llama.cpp's M2 Ultra measurements by depth and batch, docs/simulator.md; chips with less bandwidth
# for their weights reach it sooner, so this errs on the side of deep batches being slow)
DECODE_DEPTH_SCALE = 22000
# a prompt token this deep in its prompt costs twice one at its start: attention grows with the depth, the
# weights do not (Qwen3-Coder-30B-A3B on Metal, docs/simulator.md; a dense model's is deeper, so this errs on
# the side of deep prompts being slow)
PREFILL_HALVING_DEPTH = 6000


def fastest(doc: NodeDoc, expected_tokens: int, prompt_tokens: int = 0) -> Candidate:
    """The node with its expected answer time: first token, the request's own prompt at the node's measured
    prompt speed (none of it cached: the script takes off what a prefix the node holds covers), then
    ``expected_tokens`` at its slot speed brought back to an empty batch (the script scales it to the batch
    the request would join)."""
    speed, running = doc.slot_tokens_per_s, doc.slot_concurrency
    if not speed or speed <= 0 or running is None:
        return least_utilised(doc, expected_tokens, prompt_tokens)
    cost = batch_cost(doc.prefill_depth)
    lone_token_s = 1.0 / (speed * (1 + cost * max(running, 1.0)))
    ttft_s = (doc.ttft_p50_ms or 0.0) / 1000
    prefill = doc.prefill_tokens_per_s
    prefill_s = prompt_seconds(prompt_tokens, prefill, doc.prefill_depth) if prefill and prefill > 0 else 0.0
    return Candidate(doc.node_id, doc.tokens_per_s, ttft_s=ttft_s, decode_s=expected_tokens * lone_token_s,
                     prefill_s=prefill_s, batch_cost=cost)


def batch_cost(depth: float | None) -> float:
    """How much each request in a node's decode batch slows every slot's step, as a share of the step with
    none, where its requests' prompts sit ``depth`` tokens deep on average (the agent's measure; None: not
    measured, taken as shallow)."""
    return BATCH_COST + max(0.0, depth or 0.0) / DECODE_DEPTH_SCALE


def prompt_seconds(tokens: int, measured_per_s: float, measured_depth: float | None, start: int = 0) -> float:
    """``tokens`` of a prompt processed from ``start`` tokens into it (what a cache held before them), on a
    node that processed prompt tokens at ``measured_per_s`` while they sat ``measured_depth`` tokens into
    their prompts on average: a token at depth ``d`` costs ``1 + d / PREFILL_HALVING_DEPTH`` times one at
    the start. A Mac measured on a coding agent's short turns deep in its history is faster than that for a
    new session; one measured on short prompts is slower for a long one."""
    at_start = measured_per_s * (1 + max(0.0, measured_depth or 0.0) / PREFILL_HALVING_DEPTH)
    return tokens / at_start * (1 + (start + tokens / 2) / PREFILL_HALVING_DEPTH)


def least_utilised(doc: NodeDoc, expected_tokens: int, prompt_tokens: int = 0) -> Candidate:
    """The node as utilisation alone weighs it."""
    return Candidate(doc.node_id, doc.tokens_per_s)


STRATEGIES: dict[Placement, Callable[[NodeDoc, int, int], Candidate]] = {
    "fastest": fastest,
    "least-utilised": least_utilised,
}
