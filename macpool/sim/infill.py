"""``/infill``: fill in the middle, llama-server's code completion (``post_infill``).

The simulated model is a coding model with Qwen2.5-Coder's special tokens, so the prompt is laid out as
llama-server lays it out for one: the extra context (``input_extra``: other files) first, then
``<|fim_prefix|>`` prefix and prompt, ``<|fim_suffix|>`` suffix, ``<|fim_middle|>``. As there, the prefix
keeps at most its last 3/4 of a batch, the suffix its first part up to the rest of a quarter batch, and
the extra context what the slot's context leaves past one batch (``format_prompt_infill``).
"""

from __future__ import annotations

from typing import Any

from macpool.sim import tokens
from macpool.sim.chat import invalid

_EXTRA = '"input_extra" must be an array of {"filename": string, "text": string}'


def prompt(body: dict[str, Any], n_batch: int, n_ctx: int) -> str:
    """The prompt llama-server builds from an infill request (``RequestError`` as it refuses one)."""
    extra = body.get("input_extra", [])
    if "input_extra" in body and not isinstance(extra, list):
        raise invalid(_EXTRA)
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise invalid('extra_context chunk\'s "filename" field must be a string')
    for key in ("input_suffix", "input_prefix"):  # llama-server reads the suffix first
        if key not in body:
            raise invalid(f"[json.exception.out_of_range.403] key '{key}' not found")
    given = body.get("prompt")
    middle = given if isinstance(given, str) else ""  # llama-server reads a prompt that is not a string as ""
    prefix = _last(_text(body["input_prefix"]), 3 * (n_batch // 4))
    suffix = _first(_text(body["input_suffix"]), max(0, n_batch // 4 - (2 + tokens.count(middle))))
    files = "".join(f"<|file_sep|>{chunk.get('filename', 'tmp')}\n{chunk['text']}" for chunk in extra)
    # llama-server's n_predict here is the server's default (-1), not the request's
    context = _last(f"<|repo_name|>myproject\n{files}<|file_sep|>filename\n", max(0, n_ctx - n_batch + 2))
    return f"{context}<|fim_prefix|>{prefix}{middle}<|fim_suffix|>{suffix}<|fim_middle|>"


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    mixed = isinstance(value, list) and all(isinstance(t, str | int) for t in value)
    return tokens.prompt_text(value) if mixed else ""


def _last(text: str, n_tokens: int) -> str:
    return text[max(0, len(text) - n_tokens * tokens.CHARS_PER_TOKEN) :]


def _first(text: str, n_tokens: int) -> str:
    return text[: n_tokens * tokens.CHARS_PER_TOKEN]
