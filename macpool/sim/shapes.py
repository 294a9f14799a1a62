"""llama-server's JSON shapes, field for field (see ../shared/reference/llama-server/)."""

from __future__ import annotations

import json
import secrets
import string
import time
from collections.abc import Sequence
from typing import Any

from macpool.sim.engine import Task

_ALPHABET = string.ascii_letters + string.digits

# GET /props -> default_generation_settings.params, and each busy slot's params (same shape)
SLOT_PARAMS: dict[str, Any] = {
    "seed": 4294967295, "temperature": 0.800000011920929, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
    "top_k": 40, "top_p": 0.949999988079071, "min_p": 0.05000000074505806, "top_n_sigma": -1.0,
    "xtc_probability": 0.0, "xtc_threshold": 0.10000000149011612, "typical_p": 1.0, "repeat_last_n": 64,
    "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
    "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64, "mirostat": 0, "mirostat_tau": 5.0,
    "mirostat_eta": 0.10000000149011612, "adaptive_target": -1.0, "adaptive_decay": 0.8999999761581421,
    "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False,
    "n_probs": 0, "min_keep": 0, "chat_format": "Content-only", "reasoning_format": "none",
    "reasoning_in_content": False, "generation_prompt": "",
    "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
    "speculative.types": "none", "timings_per_token": False, "post_sampling_probs": False,
    "backend_sampling": False, "lora": [],
}

# /completion's final generation_settings (a superset of the slot params)
_GENERATION_EXTRA_AFTER_PENALTY = {"dry_sequence_breakers": ["\n", ":", '"', "*"]}
_GENERATION_EXTRA_AFTER_STREAM: dict[str, Any] = {"logit_bias": []}
_GENERATION_EXTRA_AFTER_MIN_KEEP = {
    "grammar": "", "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": [],
}


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def event(name: str, data: dict[str, Any]) -> bytes:
    """One named SSE event, as llama-server frames the Anthropic Messages and Responses streams."""
    return b"event: " + name.encode() + b"\ndata: " + dumps(data) + b"\n\n"


def random_id(prefix: str) -> str:
    """``prefix`` and 32 random letters and digits, as llama-server's ids (``chatcmpl-``, ``resp_``, ...)."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(32))


def completion_id() -> str:
    return random_id("chatcmpl-")


def slot_params(n_predict: int, ignore_eos: bool, stream: bool) -> dict[str, Any]:
    params = dict(SLOT_PARAMS)
    params.update(max_tokens=n_predict, n_predict=n_predict, ignore_eos=ignore_eos, stream=stream)
    params["reasoning_format"] = "deepseek"
    return params


def generation_settings(n_predict: int, ignore_eos: bool, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in slot_params(n_predict, ignore_eos, stream).items():
        if key == "max_tokens":
            out["stop"] = []
        out[key] = value
        if key == "dry_penalty_last_n":
            out.update(_GENERATION_EXTRA_AFTER_PENALTY)
        elif key == "stream":
            out.update(_GENERATION_EXTRA_AFTER_STREAM)
        elif key == "min_keep":
            out.update(_GENERATION_EXTRA_AFTER_MIN_KEEP)
    return out


def error(code: int, message: str, type_: str, **extra: Any) -> bytes:
    """llama-server's task errors: ``{"error": {"code", "message", "type", ...}}`` (this key order)."""
    return dumps({"error": {"code": code, "message": message, "type": type_, **extra}})


def error_mtc(code: int, message: str, type_: str) -> bytes:
    """The router-level errors (loading, 404): ``{"error": {"message", "type", "code"}}``."""
    return dumps({"error": {"message": message, "type": type_, "code": code}})


def usage(task: Task) -> dict[str, Any]:
    return {
        "completion_tokens": task.n_decoded,
        "prompt_tokens": task.n_prompt,
        "total_tokens": task.n_prompt + task.n_decoded,
        "prompt_tokens_details": {"cached_tokens": task.n_cache},
    }


class Shaper:
    """Builds the bodies and stream chunks for one request on one endpoint."""

    def __init__(self, model: str, fingerprint: str, include_usage: bool = False) -> None:
        self.id = completion_id()
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage

    # --- /v1/chat/completions -----------------------------------------------------------------------------
    def _chat_chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "choices": choices, "created": self.created, "id": self.id, "model": self.model,
            "system_fingerprint": self.fingerprint, "object": "chat.completion.chunk", **extra,
        }

    def chat_role_chunk(self, index: int = 0) -> dict[str, Any]:
        delta = {"role": "assistant", "content": None}
        return self._chat_chunk([{"finish_reason": None, "index": index, "delta": delta}])

    def chat_content_chunk(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chat_chunk([{"finish_reason": None, "index": index, "delta": {"content": text}}])

    def chat_final_chunks(self, task: Task, index: int = 0) -> list[dict[str, Any]]:
        final = [{"finish_reason": task.finish_reason, "index": index, "delta": {}}]
        if not self.include_usage:
            return [self._chat_chunk(final, timings=task.timings())]
        return [
            self._chat_chunk(final),
            self._chat_chunk([], usage=usage(task), timings=task.timings()),
        ]

    def chat_response(self, task: Task, text: str, more: Sequence[tuple[Task, str]] = ()) -> dict[str, Any]:
        """The answer; ``more``: the other generations' (n > 1), choices 1.. (usage, timings: the first's)."""
        choices = [
            {"finish_reason": t.finish_reason, "index": i, "message": {"role": "assistant", "content": x}}
            for i, (t, x) in enumerate([(task, text), *more])
        ]
        return {
            "choices": choices,
            "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
            "object": "chat.completion", "usage": usage(task), "id": self.id, "timings": task.timings(),
        }

    # --- /v1/completions ----------------------------------------------------------------------------------
    def _text_chunk(self, text: str, finish: str | None, index: int = 0, **extra: Any) -> dict[str, Any]:
        return {
            "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish}],
            "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint,
            "object": "text_completion", **extra,
        }

    def text_chunk(self, text: str, index: int = 0) -> dict[str, Any]:
        return {**self._text_chunk(text, None, index), "id": self.id}

    def text_final_chunk(self, task: Task, index: int = 0) -> dict[str, Any]:
        return self._text_chunk("", task.finish_reason, index, usage=usage(task), id=self.id,
                                timings=task.timings())

    def text_response(self, task: Task, text: str, more: Sequence[tuple[Task, str]] = ()) -> dict[str, Any]:
        """The answer; ``more`` are the other generations' (several prompts, n > 1): choices 1.., usage and
        timings of the first."""
        timings = task.timings()
        answer = self._text_chunk(text, task.finish_reason, usage=usage(task), id=self.id, timings=timings)
        answer["choices"] += [self._text_chunk(x, t.finish_reason, i)["choices"][0]
                              for i, (t, x) in enumerate(more, 1)]
        return answer

    # --- /completion (llama.cpp native) -------------------------------------------------------------------
    @staticmethod
    def native_chunk(text: str, token: int, task: Task, index: int = 0) -> dict[str, Any]:
        return {
            "index": index, "content": text, "tokens": [token], "stop": False, "id_slot": -1,
            "tokens_predicted": task.n_decoded, "tokens_evaluated": task.n_prompt,
        }

    def native_final(
        self, task: Task, text: str, prompt: str, n_predict: int, ignore_eos: bool, stream: bool,
        index: int = 0,
    ) -> dict[str, Any]:
        slot_id = task.slot.id if task.slot is not None else 0
        return {
            "index": index, "content": text, "tokens": [], "id_slot": slot_id, "stop": True,
            "model": self.model,
            "tokens_predicted": task.n_decoded, "tokens_evaluated": task.n_prompt,
            "generation_settings": generation_settings(n_predict, ignore_eos, stream),
            "prompt": prompt, "has_new_line": False, "truncated": False,
            "stop_type": "limit" if task.finish_reason == "length" else "eos", "stopping_word": "",
            "tokens_cached": task.n_prompt + task.n_decoded, "timings": task.timings(),
        }
