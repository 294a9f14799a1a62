"""Every repository path docs/architecture.md names exists: a file moved without the docs fails here.

A path is what a reader would look for in the tree: a backticked ``dir/file.py``, ``dir/`` or bare
``name.lua`` / ``name.py``, or the same in a diagram (a fenced block). URL paths (``/v1/...``), URLs and
content types (``text/event-stream``) are not repository paths.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/architecture.md",)
# a file is named by its extension; anything else with a slash counts only when it ends with one (a folder)
EXTENSIONS = ("py", "lua", "md", "cfg", "conf", "yml", "yaml", "toml", "json", "html", "js", "css", "plist",
              "service", "sh")
_FILE = rf"[\w.-]+\.(?:{'|'.join(EXTENSIONS)})"
# in a backtick span: the whole span is the path
_WHOLE = re.compile(rf"(?:[\w.*-]+/)+(?:{_FILE}|[\w*-]+\.(?:py|lua))?|{_FILE}|\*\.lua")
# in a diagram: a path-like word, not part of a URL path (/v1/...) or of a dotted name
_IN_DIAGRAM = re.compile(rf"(?<![\w/.:~-])((?:[\w.-]+/)+(?:{_FILE})?|{_FILE})(?![\w/])")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` (markdown) names."""
    names = set()
    for block in _FENCE.findall(text):
        names |= {match.group(1) for match in _IN_DIAGRAM.finditer(block)}
    for span in _SPAN.findall(_FENCE.sub("", text)):
        span = span.strip()
        if "://" not in span and not span.startswith("/") and _WHOLE.fullmatch(span):
            names.add(span)
    return names


def _exists(name: str) -> bool:
    if "*" in name:
        return any(ROOT.glob(name)) or any((ROOT / "macpool" / "store").glob(name))
    if "/" in name:
        return (ROOT / name).exists()
    if name.endswith(".lua"):  # the scripts are the store's
        return (ROOT / "macpool" / "store" / name).is_file()
    # a bare module name: one of the packages' or the tests'
    return (ROOT / name).exists() or any(
        any((ROOT / top).rglob(name)) for top in ("macpool", "router", "node_agent", "tests")
    )


def stale(text: str) -> list[str]:
    """The paths ``text`` names that the repository does not have."""
    return sorted(name for name in named_paths(text) if not _exists(name))


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_the_doc_names_exists(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert len(named_paths(text)) > 20, f"{doc}: the path finder found almost nothing"
    assert stale(text) == [], f"{doc} names paths the repository does not have"


def test_a_stale_path_is_found() -> None:
    text = (
        "The engine (`simulator/engine.py`) and `bench/` run `macpool/tiny_model.py`; `gone.lua` too.\n"
        "```\nrouter/app.py   the routes\nrouter/gone.py  moved\n```\n"
        "Not paths: `/v1/chat/completions`, `text/event-stream`, `redis+cluster://h/0`, `tok/s`.\n"
    )
    assert stale(text) == ["bench/", "gone.lua", "macpool/tiny_model.py", "router/gone.py",
                           "simulator/engine.py"]


def test_what_the_doc_names_includes_every_store_script() -> None:
    named = named_paths((ROOT / "docs/architecture.md").read_text())
    scripts = {path.name for path in (ROOT / "macpool" / "store").glob("*.lua")}
    modules = {path.name for path in (ROOT / "macpool" / "store").glob("*.py")}
    assert scripts - named == set(), "docs/architecture.md does not name these store scripts"
    assert modules - named == set(), "docs/architecture.md does not name these store modules"
