"""raydl bench first_step: command -> first finished step, whole build vs meta build, under torchrun (no Ray).

The other half of `raydl bench memory`'s start-up figure, where Ray is not there to run it: a GPU box (one
worker on the GPU, whose meta build materializes straight on the device while the whole build fills host
memory first and copies), or a many-core box (N CPU processes over gloo, N x --threads cores). Each side runs
`torchrun --standalone --nproc-per-node N -m raydl.worker` with raydl bench memory's settings (SGD without
momentum, micro-batch 1, 2 steps) and one model; the sides alternate. The first step record's start-up marks
(the latest over the ranks) give the phases from the command's start: worker process start (torchrun's own),
imports, process group, model built and loaded, data open, first batch, first step. The summary's peak memory
(max allocated on a GPU, RSS on CPU) comes with them.

    python -m raydl.bench.first_step --models gpt-1b                                     # one GPU
    CUDA_VISIBLE_DEVICES= python -m raydl.bench.first_step --nproc 2 --layout dp2-fsdp --threads 8
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.bench.memory import COMMON, LAYOUTS, MODELS, SIDES
from raydl.telemetry.startup import breakdown

TARGET = 0.6   # issue 23: the 1B model's time to first step at most 0.6 x the whole build's


def run_once(work: Path, sets: list[str], nproc: int, threads: int) -> dict[str, Any]:
    """One torchrun: the command -> first step phases (s) and the run's peak memory (MiB)."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raydl.worker", "-q", "--run-dir", str(run_dir), *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}   # torchrun sets 1 per process otherwise
    start = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    peak = json.loads((run_dir / "summary.json").read_text())["peak_memory_mb"]
    shutil.rmtree(run_dir, ignore_errors=True)   # the final checkpoint is the model's size
    timing = breakdown({**first["startup"], "command_start": start})
    return {"to_first_step_s": timing["to_first_step_s"], "peak_memory_mib": peak,
            **{f"phase:{name}": seconds for name, seconds in timing["phase_s"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("first_step", __doc__)
    p.set_defaults(repeats=3)
    p.add_argument("--models", nargs="+", default=["gpt-1b"], choices=[m for m in MODELS if m.startswith("gpt")])
    p.add_argument("--layout", default="dp1", choices=sorted(LAYOUTS))
    p.add_argument("--nproc", type=int, default=1, help="Worker processes (one GPU takes one; default 1).")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker (CPU runs).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = harness.parse_args(p, argv)
    session = harness.Session("first_step", args)
    work = Path(tempfile.mkdtemp(prefix="raydl-bench-first-step-"))
    layout = [s for s in LAYOUTS[args.layout] if not s.startswith("scaling.")]   # torchrun sets the world size
    results = {}
    try:
        for name in args.models:
            sets = [*COMMON, f"data.cache_dir={work / 'data'}", *MODELS[name], *layout, *args.overrides]
            runs = harness.alternate({side: (lambda extra=extra: run_once(work, [*sets, *extra], args.nproc, args.threads))
                                      for side, extra in SIDES.items()}, args.repeats)
            stats = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
            ratio = harness.ratio_of_medians([r["to_first_step_s"] for r in runs["after"]],
                                             [r["to_first_step_s"] for r in runs["before"]])
            for side in SIDES:
                print(harness.describe(f"{name} {args.layout} {side} command -> first step",
                                       stats[side]["to_first_step_s"], " s"))
                phases = {k[6:]: v["median"] for k, v in stats[side].items() if k.startswith("phase:")}
                print("  phases (medians, s): " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                      + f"; peak {stats[side]['peak_memory_mib']['median']:,.0f} MiB")
            print(f"{name} {args.layout}: after / before {ratio:.3f} (target <= {TARGET})", flush=True)
            results[name] = {"sides": stats, "after_over_before": round(ratio, 3)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    session.write(layout=args.layout, nproc=args.nproc, threads=args.threads, overrides=args.overrides,
                  models=results, target=TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
