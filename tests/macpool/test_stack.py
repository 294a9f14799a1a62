"""The process harness: what it reports when a process fails, and that stopping it leaves nothing behind."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import psutil
import pytest

from macpool.dev.stack import ProcessError, Stack, free_port

PYTHON = sys.executable


def python(code: str) -> list[str]:
    return [PYTHON, "-c", textwrap.dedent(code)]


def test_a_process_that_dies_at_start_is_named_with_its_log(tmp_path: Path) -> None:
    with Stack(logs=tmp_path, keep_logs=True) as stack:
        argv = python("import sys; print('boom: no model', flush=True); sys.exit(3)")
        with pytest.raises(ProcessError) as caught:
            stack.spawn("doomed", argv, free_port(), timeout=20)
    message = str(caught.value)
    assert "doomed" in message and str(tmp_path / "doomed.log") in message
    assert "boom: no model" in message  # the log's tail


def test_waiting_for_nodes_fails_at_once_when_a_process_exits_on_its_own(tmp_path: Path) -> None:
    with Stack(logs=tmp_path, keep_logs=True) as stack:
        stack.spawn("quitter", python("import sys; sys.exit(7)"), free_port(), ready=None)
        started = time.monotonic()
        with pytest.raises(ProcessError, match=r"quitter \(exit 7"):
            stack.wait_nodes(f"http://127.0.0.1:{free_port()}", 1, timeout=30)
        assert time.monotonic() - started < 10


def test_a_process_stopped_on_purpose_is_not_reported_as_dead(tmp_path: Path) -> None:
    with Stack(logs=tmp_path, keep_logs=True) as stack:
        proc = stack.spawn("sleeper", python("import time; time.sleep(60)"), free_port(), ready=None)
        proc.child.kill()
        assert stack.dead() == []


def test_stop_is_bounded_and_takes_the_whole_process_group(tmp_path: Path) -> None:
    stubborn = python("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("started", flush=True)
        time.sleep(60)
    """)
    stack = Stack(logs=tmp_path, keep_logs=True)
    proc = stack.spawn("stubborn", stubborn, free_port(), ready=None)
    assert proc.log_path is not None
    deadline = time.monotonic() + 20
    while "started" not in proc.log_path.read_text():  # its grandchild is running
        assert time.monotonic() < deadline
        time.sleep(0.05)
    group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert len(group) == 2
    started = time.monotonic()
    stack.stop(timeout=0.5)
    assert time.monotonic() - started < 5
    _, alive = psutil.wait_procs(group, timeout=5)
    assert not alive


def test_sigterm_to_a_program_inside_a_stack_stops_its_processes(tmp_path: Path) -> None:
    program = python(f"""
        import sys, time
        from pathlib import Path
        from macpool.dev.stack import Stack, free_port
        with Stack(logs=Path({str(tmp_path)!r}), keep_logs=True) as stack:
            proc = stack.spawn("child", [sys.executable, "-c", "import time; time.sleep(60)"], free_port(),
                               ready=None)
            print(proc.pid, flush=True)
            time.sleep(60)
    """)
    runner = subprocess.Popen(program, stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None
        child = psutil.Process(int(runner.stdout.readline()))
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(30) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs([child], timeout=5)
        assert not alive
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(10)
        if runner.stdout is not None:
            runner.stdout.close()


def test_a_server_whose_port_was_taken_before_it_bound_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        handed = iter([busy])  # the first port the stack is handed is taken by the time its server binds
        monkeypatch.setattr("macpool.dev.stack.free_port", lambda: next(handed, None) or free_port())
        with Stack(logs=tmp_path, keep_logs=True) as stack:
            sim = stack.sim("sim", "--preset", "m2pro-32g-8b-q4")
            assert sim.port != busy and [p.port for p in stack.procs] == [sim.port]
            assert httpx.get(sim.url + "/health", timeout=5).status_code == 200
            assert stack.dead() == []
