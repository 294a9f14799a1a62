"""llama-server's prompt cache in host memory (``--cache-ram``), as ``server_prompt_cache`` in
tools/server/server-task.cpp keeps it.

A slot's prompt - its text, standing for its tokens and the KV state behind them - is saved here when the slot
is about to lose it (the slot chosen for a new task whose prompt it shares too little of) and, with
``--cache-idle-slots``, whenever a new task starts while the slot is idle. A new task's slot takes the saved
prompt that best matches the task's, and the prompt leaves the cache for the slot. The cache holds at most
``limit_mib`` (the oldest prompts go first) and, with no size limit, ``limit_tokens`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from macpool.sim import tokens

# a saved prompt is only restored into a slot if at least this share of it is the new prompt's prefix
# ("don't trash large prompts")
MIN_KEEP = 0.25
MIB = 1024 * 1024


@dataclass(eq=False)
class Saved:
    text: str
    n_tokens: int


class PromptCache:
    """The saved prompts, oldest first."""

    def __init__(self, limit_mib: int, limit_tokens: int, mib_per_token: float) -> None:
        self.limit_bytes = max(0, limit_mib) * MIB  # -1 (no limit) and 0 alike: no size limit
        self.limit_tokens = limit_tokens
        self.bytes_per_token = mib_per_token * MIB
        self.saved: list[Saved] = []

    def size_bytes(self) -> float:
        return self.n_tokens() * self.bytes_per_token

    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.saved)

    def save(self, text: str) -> bool:
        """Keep a slot's prompt (``server_prompt_cache::alloc``); False when it was not kept: empty, already
        held as the prefix of a saved prompt, or larger than the whole cache."""
        n_tokens = tokens.count(text)
        if n_tokens == 0 or any(s.text.startswith(text) for s in self.saved):
            return False
        size = n_tokens * self.bytes_per_token
        if self.limit_bytes and size > self.limit_bytes:
            return False
        # an older turn of the same conversation is a prefix of this one: this one replaces it
        self.saved = [s for s in self.saved if not text.startswith(s.text)]
        while self.limit_bytes and self.saved and self.size_bytes() + size > self.limit_bytes:
            self.saved.pop(0)
        self.saved.append(Saved(text, n_tokens))
        return True

    def best(self, slot_text: str, prompt: str) -> Saved | None:
        """The saved prompt to restore into a slot holding ``slot_text`` for ``prompt``
        (``server_prompt_cache::load``): one that shares more of the new prompt than the slot does, keeping
        more of itself, and keeping at least ``MIN_KEEP`` of itself."""
        n_prompt = max(1, tokens.count(prompt))
        shared = tokens.common_prefix_tokens(slot_text, prompt) if slot_text else 0
        keep_best = shared / tokens.count(slot_text) if slot_text else -1.0
        sim_best = shared / n_prompt
        found = None
        for saved in self.saved:
            lcp = tokens.common_prefix_tokens(saved.text, prompt)
            keep, sim = lcp / saved.n_tokens, lcp / n_prompt
            if keep >= MIN_KEEP and keep > keep_best and sim > sim_best:
                found, keep_best, sim_best = saved, keep, sim
        return found

    def take(self, saved: Saved) -> None:
        """A saved prompt restored into a slot leaves the cache."""
        self.saved.remove(saved)

    def update(self) -> None:
        """Drop the oldest prompts past the limits (``server_prompt_cache::update``): the size limit, and the
        token limit raised to what the size limit holds at the current size per token."""
        while self.limit_bytes and self.saved and self.size_bytes() > self.limit_bytes:
            self.saved.pop(0)
        per_token = max(1.0, self.size_bytes() / max(1, self.n_tokens()))
        limit = self.limit_tokens
        if self.limit_bytes:
            limit = max(limit, int(self.limit_bytes / per_token))
        while self.limit_tokens and self.saved and self.n_tokens() > limit:
            self.saved.pop(0)
