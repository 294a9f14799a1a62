"""``macpool agent join LINE [agent run options]``: join this Mac to a pool in one command.

It reads the line ``macpool pool invite`` printed and writes the agent's configuration, with the pool's
secrets, to a file only this user can read (``agent.toml``, mode 0600: never argv, never a launchd plist).
It checks that this Mac reaches the pool's Redis, then runs the agent on that file. ``--service`` instead
installs it as a service that comes back after a reboot: a launchd agent on macOS, a systemd user unit on
Linux. Options it does not know are ``macpool agent run``'s (``--model``, ``--llama-server``,
``--upstream``, ``--port``, ``--host``, ``--advertise-url``, and llama-server's after ``--``); they go on the
agent's command line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import plistlib
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from macpool.identity import write_private
from macpool.invite import Invitation, InvitationError
from macpool.store import Keys, Store
from macpool.store.connect import connect

PROG = "macpool agent join"
LABEL = "com.macpool.agent"
UNIT = "macpool-agent.service"
MACOS_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"  # Homebrew's llama-server


def config_dir() -> Path:
    """Where the agent's configuration lives: ``$XDG_CONFIG_HOME/macpool``, else ``~/.config/macpool``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "macpool"


def write_config(invitation: Invitation, folder: Path) -> Path:
    """The pool's part of the agent's configuration, in a file created 0600 (its secrets never readable by
    another user, not even for a moment)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / "agent.toml"
    lines = [
        "# written by `macpool agent join`: this Mac's place in the pool. It holds secrets: keep it 0600.",
        f"redis_url = {_toml(invitation.redis_url)}",
        f"key_prefix = {_toml(invitation.key_prefix)}",
        f"node_id = {_toml(invitation.node_id)}",
    ]
    if invitation.token is not None:
        lines.append(f"token = {_toml(invitation.token)}")
    if invitation.credential is not None:  # this node's own, issued by the pool: signs its heartbeats
        credential = folder / "node.credential"
        write_private(credential, invitation.credential, replace=True)
        lines.append(f"node_credential = {_toml(str(credential))}")
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write("\n".join(lines) + "\n")
    return path


def _toml(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's."""
    return json.dumps(text)


async def _reach(invitation: Invitation, wait_s: float) -> str:
    """What this Mac sees of the pool: one line, or an OSError/redis error saying why it cannot."""
    connection = connect(invitation.redis_url, max_connections=2, socket_connect_timeout=wait_s,
                         socket_timeout=wait_s)
    try:
        store = Store(connection.client, Keys(invitation.key_prefix))
        snapshot = await store.read_pool()
    finally:
        await connection.aclose()
    others = sorted(n for n in snapshot.nodes if n != invitation.node_id)
    return f"{len(others)} other node(s) in the pool" + (f" ({', '.join(others[:5])})" if others else "")


def check(invitation: Invitation, timeout: float) -> str | None:
    """``None`` when this Mac reaches the pool's Redis, else why not, in one line."""
    try:
        print(f"{PROG}: reached the pool: {asyncio.run(_reach(invitation, timeout))}")
    except Exception as exc:  # any failure to reach is the user's network or the line: say it, no traceback
        reason = str(exc).split("\n")[0] or type(exc).__name__
        return f"cannot reach the pool's Redis ({reason}): check this Mac's network and the Redis firewall"
    return None


def agent_argv(config: Path, rest: list[str]) -> list[str]:
    """``macpool agent run`` on the written configuration, with the options given to join."""
    return [sys.executable, "-m", "macpool.cli", "agent", "run", "--config", str(config), *rest]


def install_service(argv: list[str], folder: Path) -> str:
    """Install and start the agent as this user's service; returns what was done, or raises OSError."""
    logs = folder / "agent.log"
    if platform.system() == "Darwin":
        plist = Path.home() / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        plist.parent.mkdir(parents=True, exist_ok=True)
        # a LaunchAgent: llama-server needs Metal, which needs the user's session
        plist.write_bytes(plistlib.dumps({
            "Label": LABEL, "ProgramArguments": argv, "RunAtLoad": True,
            "KeepAlive": {"SuccessfulExit": False}, "ThrottleInterval": 10, "ExitTimeOut": 60,
            "ProcessType": "Interactive", "StandardOutPath": str(logs), "StandardErrorPath": str(logs),
            "EnvironmentVariables": {"PATH": MACOS_PATH},
        }))
        domain = f"gui/{os.getuid()}"
        subprocess.run(["launchctl", "bootout", f"{domain}/{LABEL}"], capture_output=True, check=False)
        _run(["launchctl", "bootstrap", domain, str(plist)])
        return f"installed {plist} and started it (launchctl kickstart -k {domain}/{LABEL} restarts it)"
    unit = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user" / UNIT
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(
        "[Unit]\nDescription=macpool node agent\nAfter=network-online.target\n\n"
        f"[Service]\nExecStart={shlex.join(argv)}\nRestart=on-failure\nRestartSec=10\n"
        "KillSignal=SIGTERM\nTimeoutStopSec=60\n\n[Install]\nWantedBy=default.target\n"
    )
    _run(["systemctl", "--user", "daemon-reload"])
    _run(["systemctl", "--user", "enable", "--now", UNIT])
    return (f"installed {unit} and started it; for it to start at boot without a login: "
            f"sudo loginctl enable-linger {os.environ.get('USER', '$USER')}")


def _run(command: list[str]) -> None:
    if shutil.which(command[0]) is None:
        raise OSError(f"{command[0]} is not installed here")
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"`{shlex.join(command)}` failed: {(done.stderr or done.stdout).strip()}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="Other options are `macpool agent run`'s: they go on the agent's command line.",
    )
    p.add_argument("line", help="the line `macpool pool invite` printed (macpool-join-1....)")
    p.add_argument("--dir", type=Path, default=None,
                   help="where to write agent.toml (default: $XDG_CONFIG_HOME/macpool or ~/.config/macpool)")
    p.add_argument("--service", action="store_true",
                   help="install and start the agent as a service that comes back after a reboot "
                        "(launchd on macOS, a systemd user unit on Linux)")
    p.add_argument("--no-start", dest="start", action="store_false",
                   help="write the configuration and check the pool, but start nothing")
    p.add_argument("--check-timeout", type=float, default=5.0, help="seconds to reach the pool's Redis (5)")
    return p


def main(argv: list[str]) -> int:
    rest: list[str] = []
    if "--" in argv:  # llama-server's options, for the agent
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut:]
    args, unknown = _parser().parse_known_args(argv)
    rest = [*unknown, *rest]
    try:
        invitation = Invitation.decode(args.line)
    except InvitationError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if "--config" in rest:
        print(f"{PROG}: error: join writes the agent's --config itself; give its options directly",
              file=sys.stderr)
        return 2
    folder = (args.dir or config_dir()).expanduser()
    config = write_config(invitation, folder)
    print(f"{PROG}: wrote {config} (0600): node {invitation.node_id} of the pool at {invitation.key_prefix}")
    problem = check(invitation, args.check_timeout)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 1
    command = agent_argv(config, rest)
    if args.service:
        try:
            print(f"{PROG}: {install_service(command, folder)}")
        except OSError as exc:
            print(f"{PROG}: error: could not install the service: {exc}. Run the agent yourself: "
                  f"{shlex.join(command)}", file=sys.stderr)
            return 1
        return 0
    if not args.start:
        print(f"{PROG}: start it with: {shlex.join(command)}")
        return 0
    from node_agent.cli import run

    return run(command[command.index("run") + 1:])
