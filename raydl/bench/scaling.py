"""raydl bench scaling: samples/s at dp 1 and 2, under Ray and under torchrun, for each data-parallel wrapper.

    raydl bench scaling --steps 200 --repeats 5 [--set section.key=value ...]

The same default config (tiny GPT, global batch 64) trains --steps steps per side: `ray_dp1` and `ray_dp2_W`
through `run_training` (local Ray, min = max workers), `torchrun_dp1` and `torchrun_dp2_W` through
`torchrun --standalone -m raydl.worker`, for W in auto (raydl's default: it picks per layout), ddp, fsdp and
replicate (auto is Ray-only: under torchrun it picks the same as under Ray). A side's rate is the global batch
over the median step time of its steady steps (metrics.jsonl, after the first fifth), so start-up is left out.
Sides alternate, --repeats rounds. Goal (issue 15): the default 2-worker run under Ray >= 0.95 of torchrun's
best wrapper at dp=2.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
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
    args = harness.parse_args(p, argv)
    session = harness.Session("scaling", args)
    runs_dir = Path(tempfile.mkdtemp(prefix="raydl-bench-scaling-"))
    sets = [f"train.max_steps={args.steps}", f"checkpoint.every_steps={args.steps}", "telemetry.report_every=50",
            "telemetry.progress=false", "train.eval_batches=1", *args.overrides]
    sides = {"ray_dp1": _ray_side(sets, 1, "auto", runs_dir), "torchrun_dp1": _torchrun_side(sets, 1, "auto", runs_dir)}
    for wrapper in ("auto", *WRAPPERS):
        sides[f"ray_dp2_{wrapper}"] = _ray_side(sets, 2, wrapper, runs_dir)
    for wrapper in WRAPPERS:
        sides[f"torchrun_dp2_{wrapper}"] = _torchrun_side(sets, 2, wrapper, runs_dir)
    try:
        runs = harness.alternate(sides, args.repeats)
    finally:
        shutil.rmtree(runs_dir, ignore_errors=True)
    rates = {side: harness.summary([r["samples_per_s"] for r in side_runs]) for side, side_runs in runs.items()}
    for side, stats in rates.items():
        print(harness.describe(f"{side} samples/s", stats))
    best = max((f"torchrun_dp2_{w}" for w in WRAPPERS), key=lambda side: rates[side]["median"])
    ratio = rates["ray_dp2_auto"]["median"] / rates[best]["median"]
    print(f"default 2-worker run under Ray / torchrun's best at dp=2 ({best}): {ratio:.3f} (goal >= {GOAL})")
    session.write(method=__doc__, steps=args.steps, overrides=args.overrides, goal=GOAL, samples_per_s=rates,
                  torchrun_best_dp2=best, ratio_default_to_torchrun_best=ratio, within_goal=ratio >= GOAL,
                  chosen_wrapper={side: side_runs[0]["dp_wrapper"] for side, side_runs in runs.items()})
    return 0


def _ray_side(sets: list[str], workers: int, wrapper: str, runs_dir: Path):
    def side() -> dict[str, Any]:
        from raydl.driver.ray_trainer import run_training

        run_dir = tempfile.mkdtemp(dir=runs_dir)     # a new run each time, never a resume
        cfg = load_config(None, [*sets, f"scaling.min_workers={workers}", f"scaling.max_workers={workers}",
                                 f"parallel.dp_wrapper={wrapper}", f"run.dir={run_dir}"])
        return _rate(Path(run_training(cfg)["run_dir"]), cfg.train.global_batch_size)
    return side


def _torchrun_side(sets: list[str], workers: int, wrapper: str, runs_dir: Path):
    def side() -> dict[str, Any]:
        run_dir = Path(tempfile.mkdtemp(dir=runs_dir)) / "run"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
                   "-m", "raydl.worker", "--run-dir", str(run_dir),
                   *[a for s in [*sets, f"parallel.dp_wrapper={wrapper}"] for a in ("--set", s)]]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return _rate(run_dir, load_config(None, sets).train.global_batch_size)
    return side


def _rate(run_dir: Path, global_batch: int) -> dict[str, Any]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = lines[len(lines) // 5:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"samples_per_s": global_batch / statistics.median(x["step_s"] for x in steady),
            "dp_wrapper": summary["layouts"][-1]["dp_wrapper"]}
