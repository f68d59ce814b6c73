"""The one harness of every `raydl bench`: its standard arguments, alternating repeats, summary statistics
and the result file with the machine it ran on.

    p = harness.parser("overhead", __doc__)           # --repeats (default 5), --out
    args = harness.parse_args(p, argv)
    session = harness.Session("overhead", args)       # the machine, as the benchmark starts
    runs = harness.alternate({"plain": plain, "raydl": raydl}, args.repeats)
    session.write(samples_per_s={side: harness.summarize(r) for side, r in runs.items()})

A side is a function of no arguments returning a dict of its measurements (numbers, and anything else
the result file should keep). Sides run alternately in this process tree, so a burst of background load
on this shared machine lands on every side alike instead of on whichever ran at the time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from raydl.bench import procs
from raydl.errors import ConfigError

REPEATS = 5   # the project quotes medians of at least 5 runs
RESULTS = Path("benchmarks/results")

Side = Callable[[], dict[str, Any]]


def machine() -> dict[str, Any]:
    """What the numbers depend on: CPU, versions, load average and the busiest other processes now."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    info = {"nproc": os.cpu_count(), "cpu_model": models[0] if models else platform.processor(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "busiest_other_processes": procs.busiest(),
            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def alternate(sides: dict[str, Side], repeats: int, *, verbose: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Each side once per round, in the order given, for `repeats` rounds: side -> its runs in order."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for i in range(repeats):
        for name, side in sides.items():
            runs[name].append(side())
            if verbose:
                print(f"[bench] {i + 1}/{repeats} {name}: {_brief(runs[name][-1])}", flush=True)
    return runs


def _brief(measurements: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value:.4g}" for key, value in measurements.items() if _is_number(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def summary(runs: list[float]) -> dict[str, Any]:
    """median, min, max, spread = (max - min) / median (None for a zero median), and the runs in order."""
    median, low, high = statistics.median(runs), min(runs), max(runs)
    return {"median": median, "min": low, "max": high, "spread": (high - low) / median if median else None,
            "runs": list(runs)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """summary() of every numeric measurement the runs have in common."""
    keys = [key for key, value in runs[0].items() if _is_number(value)]
    return {key: summary([run[key] for run in runs]) for key in keys if all(_is_number(run.get(key)) for run in runs)}


def ratio_of_medians(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(numerator) / statistics.median(denominator)


def paired_ratios(numerator: list[float], denominator: list[float]) -> dict[str, Any]:
    """`summary` of each round's ratio: the two sides of a round ran back to back, so a machine whose speed
    drifts between rounds (this project's VM: 25-30% for minutes at a time) moves both."""
    return summary([n / d for n, d in zip(numerator, denominator, strict=True)])


def describe(name: str, stats: dict[str, Any], unit: str = "") -> str:
    spread = "" if stats["spread"] is None else f", spread {100 * stats['spread']:.0f}%"
    return (f"{name}: median {stats['median']:.4g}{unit} (min {stats['min']:.4g}, max {stats['max']:.4g}{spread}, "
            f"{len(stats['runs'])} runs)")


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """`raydl bench NAME`'s parser with the arguments every benchmark shares."""
    p = argparse.ArgumentParser(prog=f"raydl bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"Alternating runs of every side; medians are reported (default {REPEATS}).")
    p.add_argument("--out", default=str(RESULTS / f"{name}-cpu.json"), help="Result file (JSON).")
    return p


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ConfigError("--repeats", f"is {args.repeats}", f"use at least 1 (medians are quoted over {REPEATS})")
    return args


class Session:
    """One benchmark invocation: the machine as it starts, then the result file."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name, self.args = name, args
        self.machine = machine()
        self._t0 = time.perf_counter()

    def write(self, **body: Any) -> dict[str, Any]:
        machine_info = {**self.machine, "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
        result = {"benchmark": self.name, "machine": machine_info, "args": vars(self.args),
                  "repeats": self.args.repeats, "wall_s": round(time.perf_counter() - self._t0, 1), **body}
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"[bench] wrote {out}", flush=True)
        return result


def cuda_here(name: str) -> bool:
    """Whether a CUDA device is here; if not, says so as `raydl bench NAME`'s error (then exit 2)."""
    import torch

    if torch.cuda.is_available():
        return True
    print(f"raydl bench {name}: error: no CUDA device here; run it on a GPU machine", file=sys.stderr)
    return False
