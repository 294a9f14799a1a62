"""Tools a bench compares against (nginx, haproxy), installed from the system's packages when missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path


def ensure_deb(command: str, package: str, install: bool) -> str:
    """The path of ``command``, installing Debian's ``package`` (apt-get) first when it is missing."""

    def found() -> str | None:
        return shutil.which(command) or next(
            (str(p) for p in (Path("/usr/sbin") / command, Path("/usr/bin") / command) if p.exists()), None
        )

    path = found()
    if path is None and install and shutil.which("apt-get"):
        print(f"installing {package} (apt-get install -y {package}) ...", file=sys.stderr, flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=False).returncode:
            subprocess.run(["apt-get", "update", "-q"], env=env, check=False)
            subprocess.run(["apt-get", "install", "-y", "-q", package], env=env, check=False)
        path = found()
    if path is None:
        raise RuntimeError(f"{command} is not installed; `apt-get install -y {package}` did not install it")
    return path
