"""Claude Code and Codex, the coding agents whose turns the pool serves, for the tests that drive them.

``ensure("claude")`` and ``ensure("codex")`` install the pinned npm package (once, under
``<cache>/npm/<package>-<version>/``; several processes may ask at once) and return its executable.
``headless(cli, ...)`` gives what one non-interactive turn against a base URL needs: the argv, the whole
environment and the files to write first. Nothing of this machine's user reaches the CLI (its own home,
no inherited variables but ``PATH``), and the CLI makes no traffic but its model requests: no telemetry,
update checks, plugin or marketplace fetches (docs/coding-clis.md says which setting stops which).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from macpool.dev.llama_build import cache_lock, cache_root

NPM_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Package:
    """An npm package pinned to one version, and the name of the command it installs."""

    name: str
    version: str
    command: str
    source: str = ""  # what npm installs instead of the registry's name@version: a tarball or a folder

    @property
    def spec(self) -> str:
        return self.source or f"{self.name}@{self.version}"

    @property
    def folder(self) -> str:
        """``claude-code-2.1.332``: the package's name without its scope, and the version."""
        return f"{self.name.rpartition('/')[2]}-{self.version}"


PACKAGES: dict[str, Package] = {
    "claude": Package("@anthropic-ai/claude-code", "2.1.332", "claude"),
    "codex": Package("@openai/codex", "0.171.0", "codex"),
}


class InstallError(RuntimeError):
    """A CLI could not be installed; the message says what to do, in one line."""


def package(cli: str) -> Package:
    try:
        return PACKAGES[cli]
    except KeyError:
        raise ValueError(f"unknown coding CLI {cli!r} (known: {', '.join(PACKAGES)})") from None


def install_dir(cli: str) -> Path:
    return cache_root() / "npm" / package(cli).folder


def executable(cli: str, root: Path | None = None) -> Path:
    """Where the command of ``cli`` is once installed (in ``root``, by default its install folder)."""
    return (root or install_dir(cli)) / "node_modules" / ".bin" / package(cli).command


def find(cli: str) -> Path | None:
    """The installed executable of ``cli``, or None."""
    path = executable(cli)
    return path if path.is_file() else None


def ensure(cli: str) -> Path:
    """Install ``cli`` if it is not yet (npm, from the registry) and return its executable.

    The install goes to a folder of its own that is renamed into place once the command answers
    ``--version`` with the pinned version, so a folder in place is always a whole install.
    """
    pinned = package(cli)
    if (found := find(cli)) is not None:
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError(f"npm not found, needed for {pinned.spec}: install Node.js 20 or newer")
    target = install_dir(cli)
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(target.parent / f".{pinned.folder}.lock"):
        if (found := find(cli)) is not None:
            return found  # installed by whoever held the lock before us
        staging = Path(tempfile.mkdtemp(prefix=f".{pinned.folder}-", dir=target.parent))
        try:
            _npm_install(npm, pinned, staging)
            _check_version(cli, staging)
            staging.chmod(0o755)  # mkdtemp's folder is private to its creator
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return executable(cli)


def _npm_install(npm: str, pinned: Package, prefix: Path) -> None:
    argv = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
            pinned.spec]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=NPM_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise InstallError(f"npm install {pinned.spec} took more than {NPM_TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InstallError(f"npm install {pinned.spec} failed ({done.returncode}): {last}")


def _check_version(cli: str, root: Path) -> None:
    """The installed command runs and is the pinned version (the Claude Code package puts its native binary
    in place in a postinstall script, which an npm that skips scripts would leave undone)."""
    pinned = package(cli)
    with tempfile.TemporaryDirectory(prefix="macpool-cli-home-") as home:
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": home}
        try:
            done = subprocess.run([str(executable(cli, root)), "--version"], env=env, capture_output=True,
                                  text=True, timeout=60, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InstallError(f"{pinned.spec} installed but does not run: {exc}") from None
    if pinned.version not in done.stdout:
        said = (done.stdout + done.stderr).strip().replace("\n", " ")[:200]
        raise InstallError(f"{pinned.spec} installed but `{pinned.command} --version` says: {said}")


# --- one headless turn ---------------------------------------------------------------------------

KeyHeader = Literal["authorization", "x-api-key"]
DEFAULT_MAX_OUTPUT_TOKENS = 64


@dataclass(frozen=True)
class Headless:
    """One non-interactive turn: ``argv`` run in ``cwd`` with exactly ``env`` once ``files`` are written."""

    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str]
    cwd: Path

    def run(self, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Write the files, run the turn with no input, and return what it printed. A turn still running
        after ``timeout`` is killed with everything it started, and raises ``subprocess.TimeoutExpired``."""
        for path, text in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        self.cwd.mkdir(parents=True, exist_ok=True)
        with subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as process:
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                # the whole group: the CLI's own children too (codex.js runs the native binary)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
                raise
        return subprocess.CompletedProcess(self.argv, process.returncode, out, err)


@dataclass(frozen=True)
class Turn:
    """What one turn asks, whichever CLI asks it (see `headless`)."""

    base_url: str
    model: str
    api_key: str
    workdir: Path
    home: Path
    prompt: str
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    key_header: KeyHeader = "authorization"

    def base_env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", os.defpath), "HOME": str(self.home), "LANG": "C.UTF-8"}


def headless(
    cli: str,
    *,
    base_url: str,
    model: str,
    api_key: str,
    workdir: Path,
    home: Path,
    prompt: str,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    key_header: KeyHeader = "authorization",
) -> Headless:
    """One turn of ``cli`` (``"claude"`` or ``"codex"``, installed) asking ``prompt`` of ``model`` at
    ``base_url`` (the server's root: Claude Code adds ``/v1/messages``, Codex is given ``<root>/v1``).

    ``home`` becomes the CLI's whole home (settings, sessions, caches); ``workdir`` is where it works.
    ``max_output_tokens`` bounds Claude Code's answers (Codex has no such setting: the server must bound
    them). ``key_header`` is where Claude Code sends ``api_key`` (Codex always sends ``Authorization``).
    """
    exe = find(cli)
    if exe is None:
        raise InstallError(f"{package(cli).spec} is not installed: run `macpool dev coding-clis`")
    turn = Turn(base_url.rstrip("/"), model, api_key, workdir, home, prompt, max_output_tokens, key_header)
    return _TURNS[cli](exe, turn)


def _claude(exe: Path, turn: Turn) -> Headless:
    key = "ANTHROPIC_AUTH_TOKEN" if turn.key_header == "authorization" else "ANTHROPIC_API_KEY"
    model = turn.model
    env = {
        **turn.base_env(),
        "CLAUDE_CONFIG_DIR": str(turn.home / ".claude"),
        "ANTHROPIC_BASE_URL": turn.base_url,
        key: turn.api_key,
        # every model it may pick (the main one, the small fast one, the aliases) is the pool's
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(turn.max_output_tokens),
        # without it Claude Code calls api.anthropic.com besides the base URL
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    argv = [str(exe), "-p", turn.prompt, "--output-format", "json"]
    return Headless(argv, env, {}, turn.workdir)


CODEX_KEY_VARIABLE = "MACPOOL_API_KEY"


def codex_config(base_url: str, model: str) -> str:
    """Codex's ``config.toml``: one Responses provider at ``<base_url>/v1`` whose key is in
    ``$MACPOOL_API_KEY``, and nothing fetched from elsewhere (the plugin marketplace on GitHub and
    chatgpt.com, analytics)."""
    return "\n".join([
        f"model = {_toml_string(model)}",
        'model_provider = "macpool"',
        "check_for_update_on_startup = false",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[features]",
        "plugins = false",
        "",
        "[model_providers.macpool]",
        'name = "macpool"',
        f"base_url = {_toml_string(base_url + '/v1')}",
        'wire_api = "responses"',
        f'env_key = "{CODEX_KEY_VARIABLE}"',
        "",
    ])


def _toml_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _codex(exe: Path, turn: Turn) -> Headless:
    codex_home = turn.home / ".codex"
    env = {**turn.base_env(), "CODEX_HOME": str(codex_home), CODEX_KEY_VARIABLE: turn.api_key}
    # --strict-config: a setting this version does not know is an error, not a silent no-op
    argv = [str(exe), "exec", "--skip-git-repo-check", "--strict-config", "--color", "never",
            "--sandbox", "read-only", turn.prompt]
    return Headless(argv, env, {codex_home / "config.toml": codex_config(turn.base_url, turn.model)},
                    turn.workdir)


_TURNS: dict[str, Callable[[Path, Turn], Headless]] = {"claude": _claude, "codex": _codex}


def main(argv: list[str] | None = None) -> int:
    """Install both CLIs (cached) and print their paths."""
    for cli in argv or list(PACKAGES):
        try:
            print(ensure(cli))
        except (InstallError, ValueError, OSError) as exc:
            print(f"macpool: {exc}", file=sys.stderr)
            return 1
    return 0
