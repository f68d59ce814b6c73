"""raydl bench memory_overhead: the steady-state cost per step of restart from memory (on vs off).

The same run twice per round, alternating: the default run (2 workers, tiny GPT, data-parallel) with
checkpoint.memory_every_steps=1 (every rank copies its shard of the state after each step and sends it to the
state holder) and with 0 (off). Reports each side's median per-step rate (samples/s of one step, the median over
the steps after the first fifth, as summary.json's step_rate) and stopwatch samples/s, the ratio on / off of the
medians and of each round's pair (goal >= 0.97: at most 3% slower).

    raydl bench memory_overhead --repeats 5
    raydl bench memory_overhead --set parallel.pp_degree=2 --out benchmarks/results/memory-overhead-pp2-cpu.json
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.overrides import load_config

GOAL = 0.97


def one_run(sets: list[str], runs_dir: Path, every: int) -> dict[str, float]:
    from raydl.driver.ray_trainer import run_training

    summary = run_training(load_config(None, [*sets, f"checkpoint.memory_every_steps={every}",
                                              f"run.dir={tempfile.mkdtemp(dir=runs_dir)}"]))
    return {"step_rate": summary["step_rate"], "samples_per_s": summary["samples_per_s"]}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("memory_overhead", __doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Config overrides for both sides, after the benchmark's own (steps, no progress line).")
    args = harness.parse_args(p, argv)
    session = harness.Session("memory_overhead", args)
    runs_dir = Path(tempfile.mkdtemp(prefix="raydl-bench-memory-"))
    sets = [f"train.max_steps={args.steps}", "telemetry.progress=false", *args.overrides]
    runs = harness.alternate({"on": lambda: one_run(sets, runs_dir, 1), "off": lambda: one_run(sets, runs_dir, 0)},
                             args.repeats)
    stats: dict[str, Any] = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    ratios = {key: {"of_medians": harness.ratio_of_medians([r[key] for r in runs["on"]], [r[key] for r in runs["off"]]),
                    "paired": harness.paired_ratios([r[key] for r in runs["on"]], [r[key] for r in runs["off"]])}
              for key in ("step_rate", "samples_per_s")}
    for side in runs:
        print(harness.describe(f"memory {side} step rate", stats[side]["step_rate"], " samples/s"))
    print(f"ratio on / off of the median step rates {ratios['step_rate']['of_medians']:.3f} (goal >= {GOAL})")
    session.write(steps=args.steps, overrides=args.overrides, sides=stats, ratio_on_over_off=ratios, goal_ratio=GOAL)
    return 0

