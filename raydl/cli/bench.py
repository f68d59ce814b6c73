"""raydl bench NAME [args]: run the benchmark module raydl.bench.NAME (its main(argv) -> int)."""

from __future__ import annotations

import argparse
import importlib


def register(sub) -> None:
    p = sub.add_parser("bench", help="Run a benchmark: raydl bench NAME [args] (e.g. ingest).", description=__doc__)
    p.add_argument("name", help="Benchmark module under raydl.bench (e.g. ingest).")
    p.add_argument("args", nargs=argparse.REMAINDER, help="Arguments for the benchmark (see raydl bench NAME -h).")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl.errors import ConfigError

    try:
        module = importlib.import_module(f"raydl.bench.{args.name}")
    except ModuleNotFoundError as e:
        if e.name != f"raydl.bench.{args.name}":
            raise
        raise ConfigError("bench NAME", f"is {args.name!r}, which is not a module in raydl.bench",
                          "use one of the benchmarks in raydl/bench/ (e.g. ingest)") from None
    return module.main(args.args)
