"""Models from Hugging Face: a reference resolved to GGUF files, downloaded once per Mac into the Hugging Face
cache and verified.

A reference is ``org/repo:QUANT`` - the GGUF whose name carries the quantization, every part of a split one,
chosen as llama.cpp's ``-hf`` chooses it (no quant: Q4_K_M, else Q8_0, else the first GGUF) - or
``org/repo/path/file.gguf``, one file. ``huggingface_hub`` does the talking: it honours ``HF_ENDPOINT``,
``HF_TOKEN``, ``HF_HUB_OFFLINE`` and ``HF_HOME``/``HF_HUB_CACHE`` (one copy per Mac, shared with llama.cpp's
own ``-hf`` and any other tool using that cache), and resumes a download cut mid-file from where it stopped.
The files' sizes come from the hub's metadata before anything is downloaded, so that the memory budget can
decide first. Each file downloaded is checked against the SHA-256 the hub gives for it (its LFS object id):
a file that does not match is removed from the cache and refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from macpool.hub import HubRef, choose_files, model_source, parse_ref

if TYPE_CHECKING:
    from .settings import AgentSettings

log = logging.getLogger("macpool.agent")

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
PROGRESS_STEP = 10  # a log line each time a download passes another 10 percent


class HubError(Exception):
    """A reference that cannot be resolved or downloaded; the message says which and why."""


class CorruptDownload(HubError):
    """A downloaded file whose SHA-256 is not the hub's: removed from the cache."""


@dataclass(frozen=True)
class HubFile:
    """One file of a model: its name in the repository, its size, and its SHA-256 ("": not given)."""

    name: str
    size: int
    sha256: str = ""


@dataclass(frozen=True)
class Resolved:
    """A reference resolved at one commit: the files llama-server loads (the first; the others are the
    rest of a split GGUF, found beside it)."""

    ref: HubRef
    revision: str
    files: tuple[HubFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


__all__ = ["CorruptDownload", "HubError", "HubFile", "HubRef", "Progress", "Resolved", "choose_files",
           "download", "fetch", "fetch_models", "model_source", "parse_ref", "resolve", "verify"]


# --- resolving --------------------------------------------------------------------------------------------

def resolve(ref: HubRef) -> Resolved:
    """The files of ``ref`` and their sizes, from the hub (``HF_ENDPOINT``; ``HF_TOKEN``) - or, offline
    (``HF_HUB_OFFLINE=1``) or when the hub does not answer, from what the cache holds."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return _resolve_online(ref)
    except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError) as exc:
        raise HubError(f"{ref}: {_first_line(exc)}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403, 404):
            raise HubError(f"{ref}: {_first_line(exc)}") from None
        problem: Exception = exc
    except OfflineModeIsEnabled as exc:
        problem = exc
    except Exception as exc:  # the hub unreachable (huggingface_hub's transport errors): the cache may do
        if not _is_transport_error(exc):
            raise
        problem = exc
    cached = _resolve_cached(ref)
    if cached is None:
        raise HubError(f"{ref}: not in the Hugging Face cache, and the hub is not reachable "
                       f"({type(problem).__name__}: {_first_line(problem)})")
    log.info("model %s: the hub is not reachable (%s); using the cached copy", ref, type(problem).__name__)
    return cached


def _is_transport_error(exc: Exception) -> bool:
    import httpx2  # huggingface_hub's HTTP client: its transport errors are what an unreachable hub raises

    return isinstance(exc, httpx2.TransportError)


def _resolve_online(ref: HubRef) -> Resolved:
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

    if ref.file:
        meta = get_hf_file_metadata(hf_hub_url(ref.repo, ref.file))
        if meta.commit_hash is None or meta.size is None:
            raise HubError(f"{ref}: the hub's answer has no commit or size (is HF_ENDPOINT a hub?)")
        etag = meta.etag or ""
        return Resolved(ref, meta.commit_hash, (HubFile(ref.file, meta.size, etag if _SHA256.match(etag)
                                                         else ""),))
    info = HfApi().model_info(ref.repo, files_metadata=True)
    siblings = {s.rfilename: s for s in info.siblings or []}
    names = choose_files(list(siblings), ref.quant)
    if not names:
        ggufs = ", ".join(n for n in siblings if n.endswith(".gguf")) or "none"
        raise HubError(f"{ref}: no GGUF file of {ref.quant or 'the default quants'} in {ref.repo} "
                       f"(its GGUF files: {ggufs})")
    files = []
    for name in names:
        sibling = siblings[name]
        size = sibling.lfs.size if sibling.lfs else sibling.size
        if size is None:
            raise HubError(f"{ref}: the hub gives no size for {name}")
        files.append(HubFile(name, size, sibling.lfs.sha256 if sibling.lfs else ""))
    if not info.sha:
        raise HubError(f"{ref}: the hub's answer names no commit")
    return Resolved(ref, info.sha, tuple(files))


def _resolve_cached(ref: HubRef) -> Resolved | None:
    """``ref`` from the cache: the newest cached commit of its repository holding its files, or None."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return None
    repo = next((r for r in cache.repos if r.repo_id == ref.repo and r.repo_type == "model"), None)
    for revision in sorted(repo.revisions if repo else (), key=lambda r: r.last_modified, reverse=True):
        snapshot = revision.snapshot_path
        blobs = {f.file_path.relative_to(snapshot).as_posix(): f.blob_path for f in revision.files}
        names = sorted(n for n in blobs if n.endswith(".gguf"))
        chosen = ([ref.file] if ref.file in names else []) if ref.file else choose_files(names, ref.quant)
        if chosen:
            files = tuple(HubFile(name, blobs[name].stat().st_size,
                                  blobs[name].name if _SHA256.match(blobs[name].name) else "")
                          for name in chosen)
            return Resolved(ref, revision.commit_hash, files)
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# --- downloading ------------------------------------------------------------------------------------------

@dataclass
class Progress:
    """How far a model's download is, in bytes over all its files; read by the heartbeat while the
    download thread writes it (ints: each read sees one value or the other)."""

    name: str
    total: int
    done: int = 0
    _file_done: int = 0
    _logged: int = -1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 0.0

    def file_started(self, initial: int) -> None:
        with self._lock:
            self._file_done = initial
            self.done += initial

    def advance(self, n: int) -> None:
        with self._lock:
            self._file_done += n
            self.done += n
            step = int(self.percent // PROGRESS_STEP) * PROGRESS_STEP
            if step > self._logged:
                self._logged = step
                log.info("model %s: downloading, %d%% (%.2f of %.2f GB)", self.name, step, self.done / 1e9,
                         self.total / 1e9)

    def file_ended(self, size: int) -> None:
        """A file is complete at ``size`` bytes (whatever the bar counted of it)."""
        with self._lock:
            self.done += size - self._file_done
            self._file_done = 0


def _bar_class(progress: Progress) -> type[Any]:
    """A tqdm class for huggingface_hub that counts into ``progress`` (and draws a bar on a terminal)."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("disable", not sys.stderr.isatty())
            super().__init__(*args, **kwargs)
            progress.file_started(int(kwargs.get("initial") or 0))

        def update(self, n: float | None = 1) -> bool | None:
            progress.advance(int(n or 0))
            result: bool | None = super().update(n)
            return result

    return Bar


def download(resolved: Resolved, progress: Progress | None = None,
             cancelled: Callable[[], bool] = lambda: False) -> Path:
    """Every file of ``resolved`` in the cache (downloaded unless there already), each verified; the path
    of the first, which llama-server is given. Blocking: run it in a thread."""
    from huggingface_hub import hf_hub_download

    progress = progress or Progress(str(resolved.ref), resolved.size)
    paths = []
    for file in resolved.files:
        if cancelled():
            raise HubError(f"{resolved.ref}: download cancelled")
        try:
            path = Path(hf_hub_download(resolved.ref.repo, file.name, revision=resolved.revision,
                                        tqdm_class=_bar_class(progress)))
        except HubError:
            raise
        except Exception as exc:  # huggingface_hub's and the disk's errors, said in one line
            raise HubError(f"{resolved.ref}: downloading {file.name} failed: {type(exc).__name__}: "
                           f"{_first_line(exc)}") from None
        progress.file_ended(file.size)
        verify(path, file, str(resolved.ref))
        paths.append(path)
    log.info("model %s: %d file(s), %.2f GB, verified in %s", resolved.ref, len(paths), resolved.size / 1e9,
             paths[0].parent)
    return paths[0]


def _verified_marks() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / ".macpool-verified"


def verify(path: Path, file: HubFile, ref: str) -> None:
    """Check ``path`` against the hub's size and SHA-256 of ``file``, once per blob (a mark in the cache
    remembers a blob verified, by its size and modification time); a mismatch removes it from the cache."""
    blob = path.resolve()
    stat = blob.stat()
    if stat.st_size != file.size:
        _remove(path, blob)
        raise CorruptDownload(f"{ref}: {file.name} holds {stat.st_size} bytes, the hub says {file.size}: "
                              "removed from the cache")
    if not file.sha256:
        log.warning("model %s: the hub gives no SHA-256 for %s: its size alone was checked", ref, file.name)
        return
    mark = _verified_marks() / file.sha256
    seen = f"{stat.st_size} {stat.st_mtime_ns}"
    if mark.is_file() and mark.read_text() == seen:
        return
    with blob.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if digest != file.sha256:
        _remove(path, blob)
        raise CorruptDownload(f"{ref}: {file.name} has SHA-256 {digest}, the hub says {file.sha256}: "
                              "removed from the cache")
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(seen)


def _remove(pointer: Path, blob: Path) -> None:
    for item in (pointer, blob):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(item)


def fetch(ref: HubRef) -> Path:
    """``ref`` resolved, downloaded and verified; the path of its GGUF (ConfigError when it cannot be)."""
    from macpool.settings import ConfigError

    try:
        resolved = resolve(ref)
        log.info("model %s: %s, %.2f GB at %s", ref, ", ".join(f.name for f in resolved.files),
                 resolved.size / 1e9, resolved.revision[:12])
        return download(resolved)
    except HubError as exc:
        raise ConfigError(str(exc)) from None


def fetch_models(settings: AgentSettings) -> AgentSettings:
    """``settings`` with each Hugging Face model it names (``--model``, ``--models``) downloaded: the
    reference replaced by its file."""
    def fetched(source: str) -> str:
        found = model_source(source)
        return str(fetch(found)) if isinstance(found, HubRef) else source

    update: dict[str, Any] = {}
    if settings.model is not None:
        update["model"] = fetched(settings.model)
    if settings.models:
        update["models"] = {name: fetched(source) for name, source in settings.models.items()}
    return settings.model_copy(update=update)
