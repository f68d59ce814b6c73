"""`raydl` command line. Each subcommand lives in its own module with `register(subparsers)`.

    raydl train [--config FILE] [--set section.key=value ...] [--address ADDR] [--resume RUN]
    raydl config show [--config FILE] [--set ...]
    raydl plan | data | sweep | submit | jobs | bench ...

User errors (RaydlError) print one paragraph and exit 2; nothing is written.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from raydl.errors import RaydlError

COMMANDS = ("train", "config", "plan", "data", "sweep", "submit", "jobs", "bench", "export", "report", "profile")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydl", description="Elastic data- and pipeline-parallel PyTorch training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"raydl.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"raydl.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except RaydlError as e:
        print(f"raydl: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("raydl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
