"""``macpool node``: the operator's side of node identity - the pool secret, each node's credential, and
revoking one (docs/security.md, "Node identity")."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from redis.exceptions import RedisError

from macpool.contract import now_ms
from macpool.identity import (
    DEFAULT_SECRET_FILE,
    IdentityError,
    PoolSecret,
    Revocation,
    check_node_id,
    issue,
    load_secret,
    write_private,
)
from macpool.store import DEFAULT_PREFIX, Keys, Store
from macpool.store.connect import connect

PROG = "macpool node"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Node identity: each Mac proves who it is with a credential the pool issues, and can be "
        "revoked alone. The pool secret is read from a file only its owner may read (never a flag's value).",
    )
    secret = argparse.ArgumentParser(add_help=False)
    secret.add_argument(
        "--pool-secret-file", type=Path,
        default=Path(os.environ.get("MACPOOL_POOL_SECRET_FILE", str(DEFAULT_SECRET_FILE))).expanduser(),
        help=f"the pool secret, as the routers' --pool-secret-file (env MACPOOL_POOL_SECRET_FILE; default "
        f"{DEFAULT_SECRET_FILE})",
    )
    pool = argparse.ArgumentParser(add_help=False)
    pool.add_argument(
        "--redis-url", default=os.environ.get("MACPOOL_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="the pool's Redis (env MACPOOL_REDIS_URL; default redis://127.0.0.1:6379/0)",
    )
    pool.add_argument(
        "--key-prefix", default=os.environ.get("MACPOOL_KEY_PREFIX", DEFAULT_PREFIX),
        help=f"Redis key prefix, as the routers' (env MACPOOL_KEY_PREFIX; default {DEFAULT_PREFIX})",
    )
    commands = p.add_subparsers(dest="command", required=True, metavar="{init,add,revoke}")
    commands.add_parser(
        "init", parents=[secret], help="make the pool secret (once per pool)",
        description="Write a new pool secret to --pool-secret-file (mode 600; an existing file is kept). "
        "Give the same file to every router (--pool-secret-file) and keep it off the Macs.",
    )
    add = commands.add_parser(
        "add", parents=[secret], help="issue a node's credential",
        description="Print a new credential of node ID (or write it to --out, mode 600). Give it to that "
        "Mac's agent only: macpool agent run --node-credential FILE. After `revoke ID`, a credential added "
        "again brings the node back; the revoked ones stay revoked.",
    )
    add.add_argument("node_id", metavar="ID", help="the node id (the agent's --node-id; no spaces or '/')")
    add.add_argument("--out", type=Path, help="write the credential to this new file instead of printing it")
    revoke = commands.add_parser(
        "revoke", parents=[secret, pool], help="revoke every credential issued for a node until now",
        description="Revoke the credentials issued for node ID until now (its model nodes ID/<model> "
        "with them), by a record in Redis signed with the pool secret: routers send the node nothing, and "
        "a running router remembers the revocation even if the record is deleted from Redis. Bring the Mac "
        "back with a new credential (`add ID`).",
    )
    revoke.add_argument("node_id", metavar="ID", help="the node id")
    return p


def init(args: argparse.Namespace) -> int:
    write_private(args.pool_secret_file, PoolSecret.generate().encode())
    print(f"wrote a new pool secret to {args.pool_secret_file} (mode 600); give every router "
          f"--pool-secret-file {args.pool_secret_file}", file=sys.stderr)
    return 0


def add(args: argparse.Namespace) -> int:
    credential = issue(load_secret(args.pool_secret_file), args.node_id, now_ms())
    if args.out is None:
        print(credential.encode())
        where = "the line above, saved to a file of mode 600 on that Mac,"
    else:
        write_private(args.out, credential.encode())
        where = f"{args.out} (mode 600), copied to that Mac,"
    print(f"node {credential.node_id}: give {where} to its agent: macpool agent run --node-credential FILE",
          file=sys.stderr)
    return 0


def revoke(args: argparse.Namespace) -> int:
    secret = load_secret(args.pool_secret_file)
    record = Revocation.make(secret, check_node_id(args.node_id), now_ms())
    asyncio.run(_write(args.redis_url, args.key_prefix, record))
    print(f"node {args.node_id}: its credentials issued until now are revoked; routers act on it within "
          f"their --refresh-interval (a new one: {PROG} add {args.node_id})", file=sys.stderr)
    return 0


async def _write(redis_url: str, prefix: str, record: Revocation) -> None:
    connection = connect(redis_url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        await Store(connection.client, Keys(prefix)).set_revocation(record.node_id, record.encode())
    finally:
        await connection.aclose()


COMMANDS = {"init": init, "add": add, "revoke": revoke}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except IdentityError as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return 2
    except (OSError, RedisError) as exc:
        print(f"{PROG} {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
