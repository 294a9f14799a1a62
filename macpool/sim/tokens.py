"""The simulator's tokenizer: one token per 4 characters, so prompt sizes are predictable.

- A text of ``n`` characters (Unicode code points) is ``ceil(n / 4)`` tokens; token ``i`` is characters
  ``4i .. 4i+3``. Two texts share as many leading tokens as they share whole 4-character blocks.
- Chat messages are rendered with the ChatML template llama-server reports in /props
  (``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``); the checks
  llama-server makes of them first are in ``macpool/sim/chat.py``.
- A prompt given as a list of token ids (llama.cpp's native /completion) is one token per id.
- A token's id (``/tokenize``) is its 4 characters in base 128 when they are ASCII, so ``/detokenize``
  gives the text back; a piece with other characters gets an id of 2^28 or more that reads back as U+FFFD.
- Generated text is deterministic filler: token ``k`` of every answer is the ``k``-th 4-character block of a
  fixed text, so the output depends only on its length.
"""

from __future__ import annotations

import zlib
from typing import Any

CHARS_PER_TOKEN = 4
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\n' + message.content + "
    "'<|im_end|>\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n{%- endif -%}"
)
_FILLER = (
    "The quick brown fox jumps over the lazy dog while the simulated Mac keeps every slot busy and "
    "the unified memory pool fills one sequence at a time. "
)
# pad to a whole number of tokens so every generated token is exactly 4 characters
_FILLER += " " * (-len(_FILLER) % CHARS_PER_TOKEN)
_FILLER_TOKENS = len(_FILLER) // CHARS_PER_TOKEN


class PromptError(ValueError):
    """A request whose prompt or messages cannot be read."""


def count(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


def common_prefix_tokens(a: str, b: str) -> int:
    """Number of leading tokens two texts share (binary search on slice equality: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo // CHARS_PER_TOKEN


def piece(k: int) -> str:
    """The text of generated token ``k`` (0-based)."""
    i = (k % _FILLER_TOKENS) * CHARS_PER_TOKEN
    return _FILLER[i : i + CHARS_PER_TOKEN]


def filler(n_tokens: int, start: int = 0) -> str:
    return "".join(piece(k) for k in range(start, start + n_tokens))


def token_id(k: int) -> int:
    """The id of generated token ``k``."""
    return piece_id(piece(k))


_ID_BITS = 7  # an ASCII character's
_OPAQUE = 1 << (_ID_BITS * CHARS_PER_TOKEN)  # ids from here on stand for pieces that are not plain ASCII


def pieces(text: str) -> list[str]:
    return [text[i : i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN)]


def piece_id(text: str) -> int:
    if text.isascii() and "\0" not in text:
        return sum(ord(c) << (_ID_BITS * i) for i, c in enumerate(text))
    return _OPAQUE + zlib.crc32(text.encode()) % _OPAQUE


def id_piece(token: int) -> str:
    if not 0 < token < _OPAQUE:
        return "\ufffd"
    out = []
    while token:
        token, code = token >> _ID_BITS, token & ((1 << _ID_BITS) - 1)
        out.append(chr(code))
    return "".join(out)


def decode(ids: list[int]) -> str:
    return "".join(id_piece(t) for t in ids)


def _content_text(content: str | list[dict[str, str]] | None, delimiter: str = "\n") -> str:
    if content is None or isinstance(content, str):
        return content or ""
    # llama-server joins text parts with a delimiter, none before the first non-empty one
    text = ""
    for part in content:
        text += (delimiter if text else "") + part["text"]
    return text


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Apply the ChatML template: every message (``content`` a string, None, or text parts), then the
    generation prompt; a last assistant message is left open instead, for the model to continue it
    (llama-server's assistant prefill: the generation prompt, then that message's text, its parts joined
    by a blank line)."""
    prefill = bool(messages) and messages[-1]["role"] == "assistant"
    closed = messages[:-1] if prefill else messages
    out = [f"<|im_start|>{m['role']}\n{_content_text(m.get('content'))}<|im_end|>\n" for m in closed]
    if prefill:
        out.append("<|im_start|>assistant\n" + _content_text(messages[-1].get("content"), "\n\n"))
    elif add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def prompt_texts(prompt: Any) -> list[str]:
    """A /completion or /v1/completions prompt: a string, a list of token ids or a list mixing strings and
    token ids (one prompt, as llama-server reads it), or a list of those (several prompts: llama-server runs
    each as its own task)."""
    if _one_prompt(prompt):
        return [prompt_text(prompt)]
    if isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
        return [prompt_text(p) for p in prompt]
    raise PromptError("'prompt' must be a string, an array of token ids, or an array of those")


def _token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _one_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not all(_token(t) or isinstance(t, str) for t in prompt):
        return False
    # token ids only, or strings and token ids mixed (llama-server tokenizes the strings in place); strings
    # only are a list of prompts
    return any(_token(t) for t in prompt) or not prompt


def prompt_text(prompt: str | list[int | str]) -> str:
    """One prompt as text: a token id stands for a 4-character piece (one token)."""
    if isinstance(prompt, str):
        return prompt
    return "".join(t if isinstance(t, str) else f"{t % 65536:04x}" for t in prompt)


def make_prompt(n_tokens: int, salt: str = "") -> str:
    """A user text of about ``n_tokens`` tokens whose first token differs per ``salt`` (defeats the cache)."""
    head = f"[{salt}] " if salt else ""
    body_chars = max(0, n_tokens * CHARS_PER_TOKEN - len(head))
    base = "Summarise the following notes on unified memory and batching. "
    text = (base * (body_chars // len(base) + 1))[:body_chars]
    return head + text


def chat_messages(n_tokens: int, salt: str = "") -> list[dict[str, str]]:
    """Chat messages whose rendered prompt is ``n_tokens`` tokens under this tokenizer."""
    overhead = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    user_tokens = max(1, n_tokens - overhead // CHARS_PER_TOKEN)
    text = make_prompt(user_tokens, salt)
    # trim so the rendered prompt lands exactly on n_tokens (when possible)
    target_chars = n_tokens * CHARS_PER_TOKEN - overhead
    if 0 < target_chars <= len(text):
        text = text[:target_chars]
    return [{"role": "user", "content": text}]
