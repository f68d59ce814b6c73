"""raydl bench NAME [args]: run one of raydl's benchmarks (raydl.bench.NAME's main(argv) -> int);
without a NAME or with --list, list them."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from pathlib import Path

from raydl.bench import BENCHMARKS
from raydl.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("bench", help="Run a benchmark: raydl bench NAME [args]; raydl bench --list names them.",
                       description=__doc__)
    p.add_argument("--list", action="store_true", help="List the benchmarks, one line each.")
    p.add_argument("name", nargs="?", help=f"The benchmark: {', '.join(BENCHMARKS)}.")
    p.add_argument("args", nargs=argparse.REMAINDER, help="Arguments for the benchmark (see raydl bench NAME -h).")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.list or args.name is None:
        print(listing())
        return 0
    if args.name not in BENCHMARKS:
        raise ConfigError("bench NAME", f"is {args.name!r}, which is not a benchmark",
                          f"use one of: {', '.join(BENCHMARKS)} (raydl bench --list describes them)")
    return importlib.import_module(f"raydl.bench.{args.name}").main(args.args)


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    return "\n".join(f"{name:{width}s}  {summary_line(name)}" for name in BENCHMARKS)


def summary_line(name: str) -> str:
    """The first line of the benchmark's docstring, read from its source: importing it would import torch."""
    source = Path(importlib.util.find_spec(f"raydl.bench.{name}").origin).read_text()
    first = (ast.get_docstring(ast.parse(source)) or "").split("\n", 1)[0]
    return first.removeprefix(f"raydl bench {name}:").strip()
