"""Prompt-prefix hashes for prefix-cache affinity.

llama-server keeps each slot's last prompt (and its answer) in the KV cache, so the next turn of a
conversation - or any request that shares a long system prompt - is much faster on the node that served
the previous one. The router cannot tokenize, so it identifies prefixes by content:

- chat requests: chained hashes of the ``messages`` list, one per message (the prefix of the first
  message, of the first two, ...). Turn N+1 of a conversation starts with turn N's messages, so its
  hashes include every hash turn N recorded;
- completion requests with a string prompt: chained hashes of fixed-size blocks of the prompt text (a
  partial last block is not hashed: it is what the next request will extend).

The model name seeds the chain (the same text sent to two models shares no cache). Prefixes under
:data:`MIN_PREFIX_BYTES` are not hashed (too cheap to prefill to be worth steering for; the router does not
even parse them out of a request body shorter than that). At most
:data:`MAX_PREFIXES` hashes are kept per request: the two shortest (a shared system prompt) and the
longest ones (the conversation so far), of the first :data:`MAX_PARTS` messages or blocks. Admission
(``macpool/store/reserve.lua``) looks them up longest first in Redis, shared by every router
replica, and records them for the node it picks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

MAX_PREFIXES = 16
# messages or blocks hashed: a longer prompt keeps its node by its first ones. Each costs a json.dumps or a
# hash on the event loop, so a body of very many tiny messages must not be hashed whole for 16 hashes kept
MAX_PARTS = 256
# prefixes shorter than this (~100 tokens) are not worth steering for: their prefill is cheap, and pinning
# every short identical prompt to one node would only skew the load
MIN_PREFIX_BYTES = 400
BLOCK_BYTES = 1024  # UTF-8 prompt text per hashed block of a completion request
BLOCK_TOKENS = 256  # prompt tokens per hashed block when the prompt is a token list

_CHAT_PATHS = ("/v1/chat/completions",)
_PROMPT_PATHS = ("/v1/completions", "/completion")


def prefix_hashes(path: str, payload: dict[str, Any], model: str) -> tuple[str, ...]:
    """The request's prompt-prefix hashes, longest first (empty when the request has no usable prompt)."""
    if path in _CHAT_PATHS:
        parts = _messages(payload.get("messages"))
    elif path in _PROMPT_PATHS:
        parts = _blocks(payload.get("prompt"))
    else:
        return ()
    if not parts:
        return ()
    chain = hashlib.blake2b(model.encode(errors="surrogatepass"), digest_size=8).digest()
    hashes = []
    size = 0
    for part in parts:
        chain = hashlib.blake2b(chain + part, digest_size=8).digest()
        size += len(part)
        if size >= MIN_PREFIX_BYTES:
            hashes.append(chain.hex())
    if len(hashes) > MAX_PREFIXES:
        hashes = hashes[:2] + hashes[-(MAX_PREFIXES - 2):]
    return tuple(reversed(hashes))


def _messages(messages: Any) -> list[bytes]:
    if not isinstance(messages, list):
        return []
    # surrogatepass: a lone surrogate is a valid JSON escape; the body is forwarded as sent either way
    return [_canonical(m).encode(errors="surrogatepass") for m in messages[:MAX_PARTS]]


def _canonical(message: Any) -> str:
    return json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _blocks(prompt: Any) -> list[bytes]:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # OpenAI's batched form with a single prompt
    if isinstance(prompt, str):
        data = prompt[:BLOCK_BYTES * MAX_PARTS].encode(errors="surrogatepass")[:BLOCK_BYTES * MAX_PARTS]
        return [data[i:i + BLOCK_BYTES] for i in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES)]
    if isinstance(prompt, list):
        tokens = prompt[:BLOCK_TOKENS * MAX_PARTS]
        if all(isinstance(t, int) for t in tokens):
            return [json.dumps(tokens[i:i + BLOCK_TOKENS]).encode()
                    for i in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS)]
    return []
