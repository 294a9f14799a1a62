"""``macpool pool``: the pool's own files. ``certs`` makes its PKI (macpool/pki.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from macpool import pki


def _certs_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="macpool pool certs",
        description="Make a pool CA (or use the one in --out) and certificates for the routers, the nodes "
        "and Redis, each naming the hosts and IP addresses it is reached at (docs/security.md, TLS).",
    )
    p.add_argument("--out", type=Path, required=True, help="folder of the files (made 0700 if missing)")
    p.add_argument("--router", nargs="+", default=[], metavar="HOST",
                   help="the routers' host names and IP addresses: one certificate, router.pem")
    p.add_argument("--node", action="append", default=[], metavar="ID=HOST[,HOST...]",
                   help="a node (agent) id and its host names and IP addresses: node-ID.pem (repeat per Mac)")
    p.add_argument("--redis", nargs="+", default=[], metavar="HOST",
                   help="Redis's host names and IP addresses (its servers and sentinels): redis.pem")
    p.add_argument("--force", action="store_true", help="replace certificates and keys that exist")
    return p


def certs(argv: list[str]) -> int:
    """``macpool pool certs``."""
    args = _certs_parser().parse_args(argv)
    try:
        nodes = dict(pki.node_spec(text) for text in args.node)
        if len(nodes) != len(args.node):
            raise pki.PkiError("--node: a node id given twice")
        new_ca, written = pki.PoolCerts(args.out, args.router, nodes, args.redis).make(args.force)
    except pki.PkiError as exc:
        print(f"macpool pool certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"macpool pool certs: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(("a new CA" if new_ca else "the CA") + f" in {args.out}: ca.pem (give it to every router, agent "
          "and Redis), ca-key.pem (keep it off the Macs)")
    for path in written:
        if path.name not in ("ca.pem", "ca-key.pem"):
            print(f"  {path}")
    return 0


# pool subcommand -> (its main, one-line help)
COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "certs": (certs, "make a pool CA and the routers', nodes' and Redis's TLS certificates"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = ["usage: macpool pool <command> [options]", "", "commands:"]
        lines += [f"  {name:<6} {help_}" for name, (_, help_) in COMMANDS.items()]
        known = not argv or argv[0] in ("-h", "--help")
        print("\n".join(lines), file=sys.stdout if known else sys.stderr)
        return 0 if known else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])
