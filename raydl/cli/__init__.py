"""`raydl` command line. Each subcommand lives in its own module with `register(subparsers)`.

    raydl [-q | -v] COMMAND ...   (or COMMAND [-q | -v] ...: quiet = warnings and errors only)
    raydl train [--config FILE] [--set section.key=value ...] [--address ADDR] [--resume RUN]
    raydl config show [--config FILE] [--set ...]
    raydl plan | data | sweep | submit | jobs | bench ...

User errors (RaydlError) print one paragraph and exit 2; nothing is written.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import gc
import importlib
import signal
import sys

from raydl import log
from raydl.cli import output
from raydl.errors import RaydlError, say

COMMANDS = ("train", "config", "plan", "data", "sweep", "submit", "jobs", "bench", "export", "generate", "report",
            "profile")
# Commands that run Ray or the user's model code, whose stdout is their result alone (raydl.cli.output).
RESULT_COMMANDS = ("train", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydl", description="Elastic data- and pipeline-parallel PyTorch training on Ray.")
    add_verbosity_args(parser, default=log.DEFAULT)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"raydl.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"raydl.cli.{name}":
                raise
            continue
        module.register(sub)
    for command in sub.choices.values():
        add_verbosity_args(command, default=argparse.SUPPRESS)   # a command's own -q/-v keeps a global one
    return parser


def add_verbosity_args(parser: argparse.ArgumentParser, default) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", dest="verbosity", action="store_const", const=log.QUIET, default=default,
                       help="Only warnings, errors and the command's result (train: the summary JSON).")
    group.add_argument("-v", "--verbose", dest="verbosity", action="store_const", const=log.VERBOSE,
                       default=default, help="Debug lines too, and Ray's own INFO logs.")


def skip_exit_collection() -> None:
    """At exit, Python's teardown runs the cycle collector over every object still alive: with torch and Ray
    loaded, ~300k of them, most of a CPU-second at the end of every command. Frozen, they are not traversed (an
    object in a reference cycle is then not finalized at exit, which Python never promised anyway). Registered
    before Ray is imported, so it runs after Ray's shutdown; logging's flush still runs after it."""
    gc.freeze()


def main(argv: list[str] | None = None) -> int:
    if argv is None:   # the `raydl` command: its process ends with it
        atexit.register(skip_exit_collection)
    # `kill -USR1 PID` of a command that seems stuck prints every thread's Python stack on its stderr (a job's log).
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    log.configure(args.verbosity)
    try:
        with output.results_only() if args.command in RESULT_COMMANDS else contextlib.nullcontext():
            return args.func(args) or 0
    except RaydlError as e:
        return say(e)
    except KeyboardInterrupt:
        print("raydl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
