"""``macpool pool``: the operator's tasks on the pool as a whole."""

from __future__ import annotations

import sys

from macpool import invite, pki

# task -> (its main, one-line help)
TASKS = {
    "invite": (invite.main, "print the line a new Mac joins the pool with (`macpool agent join LINE`)"),
    "certs": (pki.main, "make a pool CA and the routers', nodes' and Redis's TLS certificates"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in TASKS:
        lines = ["usage: macpool pool <task> [options]", "", "tasks:"]
        lines += [f"  {name:<8} {help_}" for name, (_, help_) in TASKS.items()]
        known = not argv or argv[0] in ("-h", "--help")
        print("\n".join(lines), file=sys.stdout if known else sys.stderr)
        return 0 if known else 2
    task, _ = TASKS[argv[0]]
    return task(argv[1:])
