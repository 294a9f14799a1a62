"""Claude Code and Codex headless (macpool/dev/coding_clis.py): the install into the cache, one turn against a
stand-in that records what they send (tests/capture_server.py), how they retry a full pool, and one turn
against the real llama-server serving the tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from macpool.dev import coding_clis, tiny_model
from macpool.dev.stack import free_port
from tests.capture_server import (
    ANSWER,
    API_KEY,
    MODEL,
    TASK,
    Capture,
    Captured,
    Planned,
    Refusal,
    Sink,
    StreamError,
    summary,
    through,
)
from tests.conftest import SpawnFactory, metric, require_coding_cli, wait_until
from tests.e2e.conftest import require_llama_server
from tests.inprocess import LocalStack

CLIS = ("claude", "codex")
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "clients"
TURN_FILES = {"claude": FIXTURES / "claude-code-turn.json", "codex": FIXTURES / "codex-turn.json"}


# --- install ---------------------------------------------------------------------------------------

def test_pins_are_exact_versions_in_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MACPOOL_CACHE", str(tmp_path))
    assert coding_clis.install_dir("claude") == tmp_path / "npm" / "claude-code-2.1.332"
    bin_dir = tmp_path / "npm" / "codex-0.171.0" / "node_modules" / ".bin"
    assert coding_clis.executable("codex") == bin_dir / "codex"
    for pinned in coding_clis.PACKAGES.values():
        assert all(part.isdigit() for part in pinned.version.split(".")), pinned  # no range, no tag
    with pytest.raises(ValueError, match="unknown coding CLI 'gemini'"):
        coding_clis.ensure("gemini")


def test_an_install_in_place_is_reused_without_npm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MACPOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(coding_clis.InstallError, match=r"^npm not found, needed for @openai/codex@0\.171\.0"):
        coding_clis.ensure("codex")
    installed = coding_clis.executable("codex")
    installed.parent.mkdir(parents=True)
    installed.write_text("#!/bin/sh\n")
    assert coding_clis.ensure("codex") == installed


def require_npm() -> str:
    npm = shutil.which("npm")
    if npm is None:
        if os.environ.get("CI"):
            pytest.fail("CI: npm not found", pytrace=False)
        pytest.skip("npm not found: install Node.js 20 or newer")
    return npm


def local_package(tmp_path: Path, says: str) -> coding_clis.Package:
    """A one-command npm package packed from a folder (no registry), whose command prints ``says`` and
    whose postinstall script adds a line to ``installs.log``: what ran npm, and how often."""
    source = tmp_path / "fake-cli"
    source.mkdir()
    log = tmp_path / "installs.log"
    count = f"require('fs').appendFileSync({str(log)!r}, 'x\\\\n')"
    manifest = {"name": "fake-cli", "version": "1.0.0", "bin": {"fake-cli": "cli.js"},
                "scripts": {"postinstall": f"node -e \"{count}\""}}
    (source / "package.json").write_text(json.dumps(manifest))
    (source / "cli.js").write_text(f"#!/usr/bin/env node\nconsole.log({says!r})\n")
    packed = subprocess.run([require_npm(), "pack", "--pack-destination", str(tmp_path)], cwd=source,
                            capture_output=True, text=True, check=True)
    tarball = tmp_path / packed.stdout.split()[-1]
    return coding_clis.Package("fake-cli", "1.0.0", "fake-cli", source=str(tarball))


@pytest.mark.slow
def test_two_processes_install_once(tmp_path: Path) -> None:
    pinned = local_package(tmp_path, "1.0.0")
    script = ("import sys; from macpool.dev import coding_clis as c; from pathlib import Path; "
              f"c.PACKAGES['fake'] = c.Package('fake-cli', '1.0.0', 'fake-cli', source={pinned.source!r}); "
              "print(c.ensure('fake'))")
    env = {**os.environ, "MACPOOL_CACHE": str(tmp_path / "cache")}
    racers = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    paths = {racer.communicate(timeout=240)[0].strip() for racer in racers}
    assert [racer.returncode for racer in racers] == [0, 0]
    assert paths == {str(tmp_path / "cache" / "npm" / "fake-cli-1.0.0" / "node_modules/.bin/fake-cli")}
    assert (tmp_path / "installs.log").read_text() == "x\n"  # one npm install; the other waited and reused it
    assert sorted(p.name for p in (tmp_path / "cache" / "npm").iterdir()) == [".fake-cli-1.0.0.lock",
                                                                              "fake-cli-1.0.0"]


@pytest.mark.slow
def test_a_command_that_is_not_the_pinned_version_is_not_put_in_place(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MACPOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(coding_clis.PACKAGES, "fake", local_package(tmp_path, "0.9.9"))
    with pytest.raises(coding_clis.InstallError, match=r"`fake-cli --version` says: 0\.9\.9$"):
        coding_clis.ensure("fake")
    assert [p.name for p in (tmp_path / "cache" / "npm").iterdir()] == [".fake-cli-1.0.0.lock"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_turn_writes_its_files_and_past_its_timeout_ends_what_it_started(tmp_path: Path) -> None:
    work, env = tmp_path / "work", {"PATH": os.defpath}
    argv = ["sh", "-c", "sleep 60 & echo $! > sleeper; cat settings.toml; wait"]
    turn = coding_clis.Headless(argv, env, {work / "settings.toml": "a = 1\n"}, work)
    with pytest.raises(subprocess.TimeoutExpired):
        turn.run(timeout=1)
    sleeper = int((work / "sleeper").read_text())
    wait_until(lambda: gone(sleeper), 5, "the turn's own child gone")
    assert coding_clis.Headless(["cat", "settings.toml"], env, {}, work).run().stdout == "a = 1\n"


# --- one turn against the stand-in ----------------------------------------------------------------

StandIn = Callable[..., tuple[Capture, str]]


@pytest.fixture
def stand_in(local_stack: LocalStack) -> StandIn:
    """Serve a new `Capture` with ``plan``; its capture and its URL."""

    def serve(*plan: Planned) -> tuple[Capture, str]:
        capture = Capture(plan=list(plan))
        return capture, local_stack.serve("capture", capture.app(), ready=None).url

    return serve


@pytest.fixture
def sink() -> Iterator[Sink]:
    proxy = Sink()
    yield proxy
    proxy.close()


def turn(cli: str, base_url: str, tmp_path: Path, sink: Sink) -> coding_clis.Headless:
    require_coding_cli(cli)
    headless = coding_clis.headless(cli, base_url=base_url, model=MODEL, api_key=API_KEY,
                                    workdir=tmp_path / "work", home=tmp_path / "home", prompt=TASK)
    return through(headless, sink)


def answer_of(cli: str, done: subprocess.CompletedProcess[str]) -> str:
    """The turn's final text: Claude Code's JSON result, Codex's last message."""
    if cli == "claude":
        result: str = json.loads(done.stdout)["result"]
        return result
    return done.stdout.strip()


@pytest.mark.coding_cli
@pytest.mark.parametrize("cli", CLIS)
def test_one_turn_sends_what_its_fixture_holds(
    cli: str, stand_in: StandIn, sink: Sink, tmp_path: Path
) -> None:
    capture, url = stand_in()
    done = turn(cli, url, tmp_path, sink).run()
    assert (done.returncode, answer_of(cli, done)) == (0, ANSWER), done.stderr
    assert sink.lines == []  # nothing but the base URL: no telemetry, update or plugin traffic
    recorded = json.loads(TURN_FILES[cli].read_text())
    assert recorded["package"] == coding_clis.package(cli).spec  # a new pin needs a new recording
    assert [summary(r.record()) for r in capture.requests] == [summary(r) for r in recorded["requests"]]


@pytest.mark.coding_cli
def test_claude_code_names_its_session_and_bounds_its_answer(
    stand_in: StandIn, sink: Sink, tmp_path: Path
) -> None:
    capture, url = stand_in()
    turn("claude", url, tmp_path, sink).run()
    (sent,) = capture.requests
    body = sent.json()
    assert (sent.path, sent.query) == ("/v1/messages", "beta=true")
    assert sent.headers["authorization"] == f"Bearer {API_KEY}" and "x-api-key" not in sent.headers
    session = sent.headers["x-claude-code-session-id"]
    assert json.loads(body["metadata"]["user_id"])["session_id"] == session
    bound = coding_clis.DEFAULT_MAX_OUTPUT_TOKENS
    assert (body["model"], body["max_tokens"], body["stream"]) == (MODEL, bound, True)


@pytest.mark.coding_cli
def test_claude_code_can_send_its_key_as_x_api_key(stand_in: StandIn, sink: Sink, tmp_path: Path) -> None:
    require_coding_cli("claude")
    capture, url = stand_in()
    headless = coding_clis.headless("claude", base_url=url, model=MODEL, api_key=API_KEY,
                                    workdir=tmp_path / "w", home=tmp_path / "h", prompt=TASK,
                                    key_header="x-api-key")
    assert through(headless, sink).run().returncode == 0
    (sent,) = capture.requests
    assert sent.headers["x-api-key"] == API_KEY and "authorization" not in sent.headers


@pytest.mark.coding_cli
def test_codex_names_its_session_and_leaves_the_bound_to_the_server(
    stand_in: StandIn, sink: Sink, tmp_path: Path
) -> None:
    capture, url = stand_in()
    turn("codex", url, tmp_path, sink).run()
    (sent,) = capture.requests
    body = sent.json()
    assert (sent.path, sent.query) == ("/v1/responses", "")
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    session = sent.headers["session-id"]
    assert sent.headers["thread-id"] == body["prompt_cache_key"] == session
    assert (body["model"], body["stream"]) == (MODEL, True)
    assert "max_output_tokens" not in body and "instructions" not in body


# --- retries ---------------------------------------------------------------------------------------

def anthropic_refusal(status: int, error: str = "overloaded_error", **headers: str) -> Refusal:
    body = {"type": "error", "error": {"type": error, "message": "the pool is full"}}
    return Refusal(status, headers, body)


def openai_refusal(status: int, **headers: str) -> Refusal:
    error = {"message": "the pool is full", "type": "server_error", "code": "pool_full"}
    return Refusal(status, headers, {"error": error})


RA = "retry-after"
RETRY, NO_RETRY = {"x-should-retry": "true"}, {"x-should-retry": "false"}
# (plan, what each request got, the CLI's exit status, the least wait before the last request)
CLAUDE_RETRIES: dict[str, tuple[list[Planned], list[str], int, float]] = {
    "503, Retry-After 1": ([anthropic_refusal(503, **{RA: "1"})], ["503", "ok"], 0, 1.0),
    "529 overloaded twice": ([anthropic_refusal(529), anthropic_refusal(529)], ["529", "529", "ok"], 0, 0.3),
    "429, Retry-After 1": ([anthropic_refusal(429, "rate_limit_error", **{RA: "1"})], ["429", "ok"], 0, 1.0),
    "403 with x-should-retry": ([anthropic_refusal(403, "permission_error", **RETRY)],
                                ["403", "ok"], 0, 0.3),
    "503 api_error, x-should-retry false": ([anthropic_refusal(503, "api_error", **NO_RETRY)],
                                            ["503"], 1, 0),
    # the header does not stop it when the body says overloaded (the header does stop a 529 or a 429)
    "503 overloaded_error, x-should-retry false": ([anthropic_refusal(503, **NO_RETRY)],
                                                   ["503", "ok"], 0, 0.3),
    "529, x-should-retry false": ([anthropic_refusal(529, **NO_RETRY)], ["529"], 1, 0),
    "503, Retry-After past 60 s": ([anthropic_refusal(503, **{RA: "61"})], ["503"], 1, 0),
    # sent again at once without an optional beta: a 400 is never an answer to retry later
    "400": ([anthropic_refusal(400, "invalid_request_error")], ["400", "ok"], 0, 0),
    "overloaded error event": ([StreamError()], ["stream-error", "ok"], 0, 0.3),
    "api_error event": ([StreamError("api_error")], ["stream-error", "ok"], 0, 0),
}
CODEX_RETRIES: dict[str, tuple[list[Planned], list[str], int, float]] = {
    "503, Retry-After 1, twice": ([openai_refusal(503, **{RA: "1"})] * 2, ["503", "503", "ok"], 0, 1.0),
    "503 with x-should-retry false": ([openai_refusal(503, **NO_RETRY)],
                                      ["503", "ok"], 0, 0),
    "400": ([openai_refusal(400)], ["400"], 1, 0),
    "429, Retry-After 1, six times": ([openai_refusal(429, **{RA: "1"})] * 6, ["429"] * 6, 1, 1.0),
    "response.failed": ([StreamError()], ["stream-error", "ok"], 0, 0),
}
RETRIES = [pytest.param("claude", *case, id=f"claude: {name}") for name, case in CLAUDE_RETRIES.items()]
RETRIES += [pytest.param("codex", *case, id=f"codex: {name}") for name, case in CODEX_RETRIES.items()]


@pytest.mark.coding_cli
@pytest.mark.parametrize(("cli", "plan", "answers", "status", "least_wait"), RETRIES)
def test_how_a_refused_turn_is_retried(
    cli: str, plan: list[Planned], answers: list[str], status: int, least_wait: float, stand_in: StandIn,
    sink: Sink, tmp_path: Path,
) -> None:
    capture, url = stand_in(*plan)
    done = turn(cli, url, tmp_path, sink).run()
    sent = capture.model_requests()
    assert ([r.answer for r in sent], done.returncode) == (answers, status), done.stdout + done.stderr
    if status == 0:
        assert answer_of(cli, done) == ANSWER
    if least_wait:
        assert sent[-1].at - sent[-2].at >= least_wait
    assert all(same_request(sent[0], again) for again in sent[1:])


def same_request(first: Captured, again: Captured) -> bool:
    """``again`` asks what ``first`` asked: the same body (but for a stream asked no longer, the fallback
    of Claude Code after an error event that is not ``overloaded_error``)."""
    return {**first.json(), "stream": False} == {**again.json(), "stream": False}


@pytest.mark.coding_cli
def test_claude_code_asks_again_without_streaming_after_an_api_error_event(
    stand_in: StandIn, sink: Sink, tmp_path: Path
) -> None:
    capture, url = stand_in(StreamError("api_error"), StreamError())
    turn("claude", url, tmp_path, sink).run()
    assert [r.json()["stream"] for r in capture.model_requests()] == [True, False]


# --- one turn against the real llama-server -------------------------------------------------------

# The tiny model never ends an answer (no </s>), so every answer runs to max_tokens, and Claude Code takes
# a max_tokens stop for a failed turn. A grammar that accepts only this text makes llama-server end each
# answer with it; the prompt, what costs, is read whole all the same.
GRAMMAR = 'root ::= "Hello."'


@pytest.fixture
def llama_server(spawn: SpawnFactory) -> str:
    """The real llama-server serving the tiny model on one thread with one 64K-token slot: its URL."""
    binary = require_llama_server()
    port = free_port()
    argv = [str(binary), "-m", str(tiny_model.ensure("tiny")), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "--ctx-size", "65536", "-np", "1", "--metrics", "--grammar", GRAMMAR]
    return spawn(argv=argv, port=port, name="llama-server", timeout=60).url


@pytest.mark.slow
@pytest.mark.llama_server
@pytest.mark.coding_cli
@pytest.mark.parametrize(("cli", "least_tokens"), [("claude", 20_000), ("codex", 25_000)])
def test_one_turn_against_the_real_llama_server(
    cli: str, least_tokens: int, llama_server: str, sink: Sink, tmp_path: Path
) -> None:
    done = turn(cli, llama_server, tmp_path, sink).run(timeout=280)
    assert (done.returncode, answer_of(cli, done)) == (0, "Hello."), done.stdout + done.stderr
    assert sink.lines == []
    assert metric(llama_server, "llamacpp:prompt_tokens_total") >= least_tokens
