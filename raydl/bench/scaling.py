"""raydl bench scaling: samples/s at dp 1 and 2, under Ray and under torchrun, for each data-parallel wrapper.

    raydl bench scaling --steps 200 --repeats 5 [--set section.key=value ...]

The same default config (tiny GPT, global batch 64) trains --steps steps per side: `ray_dp1` and `ray_dp2_W`
through `run_training` (local Ray, min = max workers), `torchrun_dp1` and `torchrun_dp2_W` through
`torchrun --standalone -m raydl.worker`, for W in auto (raydl's default: it picks per layout), ddp, fsdp and
replicate (auto is Ray-only: under torchrun it picks the same as under Ray; --wrappers narrows the list). A
side's rate is its summary.json's samples/s: the samples of its steady steps (after the first fifth, so start-up
is left out) over their elapsed wall-clock time, reports and the checkpoint between them included; the median
per-step rate is kept beside it as step_rate. Sides alternate, --repeats rounds. Goals (issues 15 and 26): the
default 2-worker run under Ray >= 0.95 of torchrun's best wrapper at dp=2, and faster than one worker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.overrides import load_config

GOAL = 0.95
WRAPPERS = ("ddp", "fsdp", "replicate")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("scaling", __doc__)
    p.add_argument("--steps", type=int, default=200, help="Training steps per run.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Config overrides for every side.")
    p.add_argument("--wrappers", default=",".join(WRAPPERS), help="Data-parallel wrappers to time at dp=2 "
                   f"(default {','.join(WRAPPERS)}; auto always runs under Ray).")
    args = harness.parse_args(p, argv)
    session = harness.Session("scaling", args)
    runs_dir = Path(tempfile.mkdtemp(prefix="raydl-bench-scaling-"))
    wrappers = tuple(w for w in args.wrappers.split(",") if w)
    sets = [f"train.max_steps={args.steps}", "telemetry.progress=false", "train.eval_batches=1", *args.overrides]
    sides = {"ray_dp1": _ray_side(sets, 1, "auto", runs_dir), "torchrun_dp1": _torchrun_side(sets, 1, "auto", runs_dir)}
    for wrapper in ("auto", *wrappers):
        sides[f"ray_dp2_{wrapper}"] = _ray_side(sets, 2, wrapper, runs_dir)
    for wrapper in wrappers:
        sides[f"torchrun_dp2_{wrapper}"] = _torchrun_side(sets, 2, wrapper, runs_dir)
    try:
        runs = harness.alternate(sides, args.repeats)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
    rates = {side: harness.summary([r["samples_per_s"] for r in side_runs]) for side, side_runs in runs.items()}
    step_rates = {side: harness.summary([r["step_rate"] for r in side_runs]) for side, side_runs in runs.items()}
    for side, stats in rates.items():
        print(harness.describe(f"{side} samples/s (wall-clock)", stats))
    best = max((f"torchrun_dp2_{w}" for w in wrappers), key=lambda side: rates[side]["median"])
    ratio = rates["ray_dp2_auto"]["median"] / rates[best]["median"]
    speedup = rates["ray_dp2_auto"]["median"] / rates["ray_dp1"]["median"]
    print(f"default 2-worker run under Ray / torchrun's best at dp=2 ({best}): {ratio:.3f} (goal >= {GOAL})")
    print(f"default 2-worker run / 1 worker under Ray: {speedup:.3f} (goal > 1)")
    session.write(method=__doc__, steps=args.steps, overrides=args.overrides, goal=GOAL, samples_per_s=rates,
                  step_rate=step_rates, torchrun_best_dp2=best, ratio_default_to_torchrun_best=ratio,
                  within_goal=ratio >= GOAL, ray_dp2_over_dp1=speedup,
                  chosen_wrapper={side: side_runs[0]["dp_wrapper"] for side, side_runs in runs.items()})
    return 0


def _ray_side(sets: list[str], workers: int, wrapper: str, runs_dir: Path):
    def side() -> dict[str, Any]:
        from raydl.driver.ray_trainer import run_training

        run_dir = tempfile.mkdtemp(dir=runs_dir)     # a new run each time, never a resume
        cfg = load_config(None, [*sets, f"scaling.min_workers={workers}", f"scaling.max_workers={workers}",
                                 f"parallel.dp_wrapper={wrapper}", f"run.dir={run_dir}"])
        return _rate(Path(run_training(cfg)["run_dir"]))
    return side


def _torchrun_side(sets: list[str], workers: int, wrapper: str, runs_dir: Path):
    def side() -> dict[str, Any]:
        run_dir = Path(tempfile.mkdtemp(dir=runs_dir)) / "run"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                   "-m", "raydl.worker", "--run-dir", str(run_dir),
                   *[a for s in [*sets, f"parallel.dp_wrapper={wrapper}"] for a in ("--set", s)]]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return _rate(run_dir)
    return side


def _rate(run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "step_rate": summary["step_rate"],
            "dp_wrapper": summary["layouts"][-1]["dp_wrapper"]}
