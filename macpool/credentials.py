"""The pool's shared secrets (the admin key, the read key, the agent token): read from a file or the
environment, checked before a process starts, and the rule for serving beyond loopback without them.

docs/security.md says what each secret guards and where to keep it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from macpool import logs

MIN_SECRET_CHARS = 16
# what an example file or a README tells its reader to replace; a secret that still says so was not replaced
_PLACEHOLDER = re.compile(
    r"change[-_ ]?me|replace[-_ ]?me|placeholder|example|your[-_ ]|^<.*>$|^x+$|^(secret|password|token|key)$",
    re.IGNORECASE,
)


class SecretError(ValueError):
    """A secret that cannot be used; the message names the setting, never the value."""


def check_secret(value: str, setting: str) -> str:
    """``value`` when it is a secret worth the name: not a placeholder, at least ``MIN_SECRET_CHARS``
    characters, no whitespace."""
    if _PLACEHOLDER.search(value):
        raise SecretError(f"{setting} is a placeholder (it says change-me, example, ...): generate one, "
                          "e.g. `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"{setting} is {len(value)} characters: at least {MIN_SECRET_CHARS} are needed")
    if any(c.isspace() for c in value):
        raise SecretError(f"{setting} holds whitespace")
    return value


def read_secret(path: Path, setting: str) -> str:
    """The secret in ``path``: its first line, without the line end (how ``echo`` or an editor left it)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SecretError(f"{setting}={str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SecretError(f"{setting}={str(path)!r}: not UTF-8 text") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise SecretError(f"{setting}={str(path)!r}: the file is empty")
    return lines[0].strip()


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` serves this machine only (a name other than localhost may resolve
    anywhere, so it does not count)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposed_without_auth(host: str, guarded: bool, trusted_network: bool) -> bool:
    """Whether a process would serve ``host`` beyond loopback with no credential and no word that the network
    is trusted: it must not start."""
    return not is_loopback(host) and not guarded and not trusted_network


def warn_on_command_line(prog: str, argv: Sequence[str], flags: Sequence[str]) -> None:
    """One line on stderr for each secret given as a flag: any local user sees it in ``ps``. Written before
    the settings are read (so a bad setting or ``--help`` still shows it), in the log format the command
    line or the environment asks for: with ``--log-format json`` every line is a JSON object."""
    for flag in flags:
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
            message = (f"{flag} on the command line is visible to every local user (ps); use {flag}-file or "
                       "the environment")
            if _log_format(argv) == "json":  # as the process's own lines will be (logs.configure again later)
                logs.configure("warning", "json")
                logging.getLogger(prog.replace(" ", ".")).warning(message)
            else:
                print(f"{prog}: warning: {message}", file=sys.stderr)


def _log_format(argv: Sequence[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--log-format="):
            return arg.partition("=")[2]
        if arg == "--log-format" and i + 1 < len(argv):
            return argv[i + 1]
    return os.environ.get("MACPOOL_LOG_FORMAT", "text")
