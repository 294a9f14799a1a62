"""Models on Hugging Face as the pool names them: ``org/repo:QUANT`` (as llama.cpp's ``-hf`` takes it) or
``org/repo/path/file.gguf``, and which files of a repository a quant is. The agent resolves and downloads
them (node_agent/hub.py); ``macpool models add`` checks them."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

# org/repo, then :QUANT or /path/to/file.gguf (or nothing); an optional hf.co/ or huggingface.co/ in front
_REF = re.compile(
    r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?"
    r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?::(?P<quant>[\w.-]+)|/(?P<file>[^:]+\.gguf))?$"
)
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama.cpp's choice when a reference names no quant
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # (llama.cpp's list)


class HubRef(BaseModel):
    """A model on the hub: ``repo`` and either a ``quant`` (a tag, as llama.cpp's ``-hf``) or a ``file``."""

    model_config = ConfigDict(frozen=True)

    repo: str
    quant: str = ""
    file: str = ""

    def __str__(self) -> str:
        if self.file:
            return f"{self.repo}/{self.file}"
        return f"{self.repo}:{self.quant}" if self.quant else self.repo


def parse_ref(text: str) -> HubRef | None:
    """``text`` as a hub reference, or None when it is not one."""
    match = _REF.match(text.strip())
    if match is None or match["repo"].endswith(".gguf"):  # (a relative path to a file: not a repository)
        return None
    return HubRef(repo=match["repo"], quant=match["quant"] or "", file=match["file"] or "")


def model_source(text: str) -> Path | HubRef:
    """A model as given on the command line: a file that exists, or anything path-like (``/``, ``~``,
    ``.``), is a path; else a hub reference when it reads as one; else a path (which the settings check
    then reports missing)."""
    path = Path(text).expanduser()
    if path.exists() or text.startswith(("/", "~", ".")):
        return path
    ref = parse_ref(text)
    return ref if ref is not None else path


# --- choosing the files of a quant ------------------------------------------------------------------------

def _split(name: str) -> tuple[str, int, int]:
    """A GGUF's name without ``.gguf`` and its split part (``-00001-of-00003``): (prefix, index, count)."""
    stem = name.removesuffix(".gguf")
    match = _SPLIT.match(stem)
    return (match["prefix"], int(match["index"]), int(match["count"])) if match else (stem, 1, 1)


def _is_model(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith(".gguf") and not any(word in base for word in _NOT_MODELS)


def choose_files(names: list[str], quant: str) -> list[str]:
    """The files of ``quant`` among a repository's ``names``, first part first; [] when none matches.
    As llama.cpp: the first model GGUF whose name has the tag followed by ``.`` or ``-`` (case ignored),
    split parts other than the first skipped; no quant: Q4_K_M, then Q8_0, then the first model GGUF."""
    models = [n for n in names if _is_model(n) and _split(n)[1] == 1]
    first = None
    for tag in [quant] if quant else list(DEFAULT_QUANTS):
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        first = next((n for n in models if pattern.search(n)), None)
        if first is not None:
            break
    if first is None and not quant and models:
        first = models[0]
    if first is None:
        return []
    prefix, _, count = _split(first)
    if count == 1:
        return [first]
    parts = [n for n in names if n.endswith(".gguf") and _split(n)[0] == prefix and _split(n)[2] == count]
    return sorted(parts, key=lambda n: _split(n)[1])
