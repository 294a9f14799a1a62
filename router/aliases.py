"""Model aliases: the names clients send for a model the pool serves under another name.

Coding agents name their own models (Claude Code sends ``claude-sonnet-4-5-...`` and asks a second, "small
fast" model for side tasks; Codex sends ``gpt-5-codex``). ``--model-aliases 'claude-*=qwen3-coder'`` maps
them: exact names first, then glob patterns (``*``, ``?``, ``[...]``) in the order given. The alias is
applied before routing, so admission, affinity and metrics see the served model, and the body llama-server
gets names it too (it answers with its own model's name). A name matching no alias is routed as it is.
"""

from __future__ import annotations

import fnmatch
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_settings import NoDecode


def _table(value: Any) -> Any:
    """``pattern=model,pattern=model`` (a flag, the environment) or a TOML table, as a dict."""
    if not isinstance(value, str):
        return value
    table: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in value.split(","))):
        pattern, sep, model = (part.strip() for part in entry.partition("="))
        if not sep or not pattern or not model:
            raise ValueError(f"{entry!r} is not an alias: NAME=MODEL or PATTERN=MODEL (claude-*=qwen3-coder)")
        table[pattern] = model
    return table


AliasTable = Annotated[dict[str, str], NoDecode, BeforeValidator(_table)]


def is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


class Aliases:
    def __init__(self, table: dict[str, str]) -> None:
        self.exact = {name: model for name, model in table.items() if not is_pattern(name)}
        self.patterns = [(name, model) for name, model in table.items() if is_pattern(name)]

    def resolve(self, name: str) -> str:
        """The model the pool serves for ``name`` (``name`` itself when no alias applies)."""
        model = self.exact.get(name)
        if model is not None:
            return model
        for pattern, target in self.patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return target
        return name

    def of(self, model: str) -> list[str]:
        """The aliases (names and patterns) that map to ``model``."""
        return [name for name, target in (*self.exact.items(), *self.patterns) if target == model]
