"""The ``macpool`` console script: one subcommand per package, each owning its own code."""

from __future__ import annotations

import importlib
import sys

from macpool.plotting import PlotUnavailable

# subcommand -> (module with ``main(argv) -> int``, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "router": ("router.cli", "run the router (the pool's single OpenAI-compatible endpoint)"),
    "agent": ("node_agent.cli", "run or calibrate the node agent on a Mac"),
    "sim": ("macpool.sim.cli", "run a simulated Mac running llama-server"),
    "bench": ("macpool.bench.cli", "load sweeps, seed table, overload and router-cost benchmarks"),
    "autoscale": ("macpool.autoscale.cli", "act on demand: standby Macs, Wake-on-LAN, scale to zero"),
    "pool": ("macpool.pool", "the operator's tasks: invite a Mac to join"),
    "demo": ("macpool.demo", "start a whole simulated pool with a dashboard in one command"),
    "models": ("macpool.models_cli", "the models the pool serves, from Hugging Face, on how many Macs"),
    "top": ("router.top", "live terminal view of the pool"),
    "node": ("macpool.node_cli", "node identity: the pool secret, a node's credential, revoking one"),
    "dev": ("macpool.dev.cli", "developer tasks: build llama-server, generate a tiny model, run the tests"),
}


def _usage() -> str:
    lines = ["usage: macpool <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "run `macpool <command> --help` for a command's options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from macpool import __version__

        print(__version__)
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        print(f"macpool: unknown command {args[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    try:
        result: int = module.main(args[1:])
    except PlotUnavailable as exc:  # an optional extra is missing: a one-line answer, not a traceback
        print(f"macpool: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
