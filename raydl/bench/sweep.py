"""raydl bench sweep: a small `raydl sweep`'s per-trial start (trial start -> its first finished step), goal <= 10 s.

Each repeat is a new sweep of --trials one-worker trials (the default sweep's shape: built-in data, tiny
GPT, --steps steps each, trials differing only in train.seed) on one private local Ray. Per repeat it
records the median and the slowest trial start as the sweep report has them (start_s: from Tune's
on_trial_start), the first trial's first step counted from the sweep's start (Tune's setup and the trial
actors' start, paid once per sweep) and the sweep's wall time per trial.

    raydl bench sweep --repeats 5
    raydl bench sweep --trials 4 --steps 20 --repeats 3
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from raydl.bench import harness

GOAL_S = 10.0


def sweep_file(trials: int, steps: int, runs_dir: str) -> dict[str, Any]:
    return {"name": "bench-sweep",
            "base": {"run": {"runs_dir": runs_dir}, "scaling": {"min_workers": 1, "max_workers": 1},
                     "train": {"max_steps": steps, "warmup_steps": 2},
                     "telemetry": {"report_every": 10, "progress": False}, "checkpoint": {"every_steps": steps}},
            "space": {"train.seed": list(range(trials))}, "objective": "eval_loss"}


def one_sweep(trials: int, steps: int) -> dict[str, Any]:
    from raydl.tune.space import parse_sweep
    from raydl.tune.sweep import run_sweep

    t0 = time.time()
    summary = run_sweep(parse_sweep(sweep_file(trials, steps, tempfile.mkdtemp(prefix="raydl-bench-sweep-"))))
    rows = summary["trials"]
    starts = [r["start_s"] for r in rows if r.get("start_s") is not None]
    if len(starts) != trials or any(r["status"] != "ok" for r in rows):
        raise RuntimeError(f"the bench sweep did not finish every trial: {[(r['trial'], r['status']) for r in rows]}")
    return {"median_start_s": statistics.median(starts), "max_start_s": max(starts),
            "first_step_after_sweep_s": min(r["first_step_after_sweep_s"] for r in rows),
            "wall_per_trial_s": (time.time() - t0) / trials, "start_s": starts}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("sweep", __doc__)
    p.add_argument("--trials", type=int, default=4, help="Trials per sweep (default 4).")
    p.add_argument("--steps", type=int, default=20, help="Training steps per trial (default 20).")
    args = harness.parse_args(p, argv)
    session = harness.Session("sweep", args)
    runs = harness.alternate({"sweep": lambda: one_sweep(args.trials, args.steps)}, args.repeats)["sweep"]
    stats = harness.summarize(runs)
    every_start = harness.summary([s for run in runs for s in run["start_s"]])
    for key in ("median_start_s", "max_start_s", "first_step_after_sweep_s", "wall_per_trial_s"):
        print(harness.describe(key, stats[key], " s"))
    print(harness.describe("every trial's start_s", every_start, " s"))
    verdict = "meets" if every_start["median"] <= GOAL_S else "misses"
    print(f"median trial start {every_start['median']:.2f} s {verdict} the goal (<= {GOAL_S:g} s)")
    session.write(trials=args.trials, steps=args.steps, sides={"sweep": stats}, every_start_s=every_start,
                  goal_s=GOAL_S)
    return 0
