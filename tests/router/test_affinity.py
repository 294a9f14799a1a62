"""router/affinity.py: prompt-prefix hashes, and what they cost the router."""

from __future__ import annotations

import time
from typing import Any

from router.affinity import MAX_PARTS, prefix_hashes


def _chat(count: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"turn {i} " + "x" * 40} for i in range(count)]}


def test_a_prompt_is_hashed_by_its_first_parts_only() -> None:
    # each message costs a json.dumps: 250,000 tiny ones in an 8 MB body held the event loop 2 s, for 16
    # hashes kept. Past MAX_PARTS messages (or blocks) a conversation keeps its node by its first ones
    capped = prefix_hashes("/v1/chat/completions", _chat(MAX_PARTS), "m")
    assert capped and prefix_hashes("/v1/chat/completions", _chat(MAX_PARTS + 50), "m") == capped
    assert prefix_hashes("/v1/chat/completions", _chat(MAX_PARTS - 1), "m")[0] != capped[0]
    tokens = {"prompt": list(range(256 * (MAX_PARTS + 10)))}
    assert prefix_hashes("/completion", tokens, "m") == prefix_hashes(
        "/completion", {"prompt": tokens["prompt"][: 256 * MAX_PARTS]}, "m")
    flood = {"messages": [{"role": "user", "content": ""}] * 250_000}
    started = time.perf_counter()
    assert prefix_hashes("/v1/chat/completions", flood, "m")
    assert time.perf_counter() - started < 0.5  # 2 s before
