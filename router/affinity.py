"""Prompt-prefix hashes for prefix-cache affinity.

llama-server keeps each slot's last prompt (and its answer) in the KV cache, so the next turn of a
conversation - or any request that shares a long system prompt - is much faster on the node that served
the previous one. The router cannot tokenize, so it identifies prefixes by content: the request's dialect
(router/dialects/) cuts its prompt into parts, each extending the one before - what is rendered before the
messages (tools, a system prompt or instructions), then each message or input item; fixed-size blocks of a
completion prompt - and the router hashes them as a chain (the prefix of the first part, of the first two,
...). Turn N+1 of a conversation starts with turn N's parts, so its hashes include every hash turn N
recorded.

The model name seeds the chain (the same text sent to two models shares no cache). Prefixes under
:data:`MIN_PREFIX_BYTES` are not hashed (too cheap to prefill to be worth steering for; the router does not
even parse them out of a request body shorter than that). At most :data:`MAX_PREFIXES` hashes are kept per
request: a session's, the two shortest (a shared system prompt) and the longest ones (the conversation so
far). Each goes with the share of the prompt it covers, so placement can count the prefill a node's cache
saves.

A client that names its session (Claude Code, Codex: router/dialects/base.py ``session``) is kept on the Mac
that holds it by one more entry, first: the session's hash, which maps to the node that served its last turn,
whatever changed in its prompt since. Prefix affinity stays the fallback for clients that send no key.
Admission (``macpool/store/reserve.lua``) looks them up longest first in Redis, shared by every router
replica, and records them for the node it picks.
"""

from __future__ import annotations

import hashlib

MAX_PREFIXES = 16
# prefixes shorter than this (~100 tokens) are not worth steering for: their prefill is cheap, and pinning
# every short identical prompt to one node would only skew the load
MIN_PREFIX_BYTES = 400


# a session's entry covers what the content prefixes its node holds cover (reserve.lua)
SESSION_SHARE = -1.0


def prefix_hashes(
    parts: list[bytes], model: str, session: str = ""
) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """The hashes of the prompt's prefixes made of ``parts``, longest first, and the share of the prompt
    each covers; a ``session`` the client names comes first, as the longest prefix of all."""
    seed = hashlib.blake2b(model.encode(errors="surrogatepass"), digest_size=8).digest()
    hashes, shares = [], []
    total = sum(len(part) for part in parts) or 1
    chain, size = seed, 0
    for part in parts:
        chain = hashlib.blake2b(chain + part, digest_size=8).digest()
        size += len(part)
        if size >= MIN_PREFIX_BYTES:
            hashes.append(chain.hex())
            shares.append(round(size / total, 4))
    if len(hashes) > MAX_PREFIXES - 1:
        keep = [0, 1, *range(len(hashes) - (MAX_PREFIXES - 3), len(hashes))]
        hashes, shares = [hashes[i] for i in keep], [shares[i] for i in keep]
    hashes.reverse()
    shares.reverse()
    if session:
        key = hashlib.blake2b(seed + b"session\0" + session.encode(errors="surrogatepass"), digest_size=8)
        hashes.insert(0, "s" + key.hexdigest())
        shares.insert(0, SESSION_SHARE)
    return tuple(hashes), tuple(shares)


def session_digest(session: str) -> str:
    """What a node is told of a session the client names (``X-Macpool-Session``): enough to tell sessions
    apart, not the client's own id."""
    return hashlib.blake2b(session.encode(errors="surrogatepass"), digest_size=8).hexdigest()
