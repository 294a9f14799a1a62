"""The Lua scripts, read from this package's ``.lua`` files."""

from __future__ import annotations

from importlib.resources import files


def source(name: str) -> str:
    """The text of ``name``.lua; the admission scripts are preceded by the helpers they share (lib.lua)."""
    text = files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
    if name in SHARING_LIB:
        return files(__package__).joinpath("lib.lua").read_text(encoding="utf-8") + "\n" + text
    return text


SHARING_LIB = frozenset({"reserve", "release", "leave", "offer", "beat", "renew", "forget"})
