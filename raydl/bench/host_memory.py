"""raydl bench host_memory: one worker's step rate and peak RSS with glibc's own mmap threshold vs raydl's fixed one.

train.host_mmap_threshold_kib (raydl.train.host_memory) maps host allocations of at least that size from the OS
and returns them when freed; glibc's default (0 here) raises its threshold as large blocks are freed and then
keeps them in its heap. Each side is a fresh `python -m raydl.worker` (the setting is per process), one worker, no
Ray, alternating per round; reported: the run's step rate (summary.json, median over its steady steps) and the
worker's whole-run peak RSS (debug.memory_dir), medians over the rounds, and the ratio fixed / glibc.

    raydl bench host_memory --repeats 5                     # the default tiny gpt (the default run's model)
    raydl bench host_memory --set model.options.layers=12 --set model.options.width=768 --set model.options.heads=12
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

SIDES = {"glibc": 0, "fixed": 1024}


def one_run(sets: list[str], threshold_kib: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="raydl-bench-host-"))
    cmd = [sys.executable, "-m", "raydl.worker", "-q", "--run-dir", str(work / "run"), *(
        a for s in [*sets, f"train.host_mmap_threshold_kib={threshold_kib}", f"debug.memory_dir={work / 'mem'}"]
        for a in ("--set", s))]
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
        summary = json.loads((work / "run" / "summary.json").read_text())
        marks = json.loads((work / "mem" / "memory-rank0.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)   # the run's checkpoints: a GB per run for a 100M model
    return {"step_rate": summary["step_rate"], "peak_rss_mib": marks["end_peak_mib"]}


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("host_memory", __doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Config overrides for both sides, after the benchmark's own (steps, no progress line).")
    args = harness.parse_args(p, argv)
    session = harness.Session("host_memory", args)
    sets = [f"train.max_steps={args.steps}", "telemetry.progress=false", "train.eval_batches=1", *args.overrides]
    runs = harness.alternate({side: (lambda kib=kib: one_run(sets, kib)) for side, kib in SIDES.items()},
                             args.repeats)
    stats: dict[str, Any] = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    ratios = {key: harness.ratio_of_medians([r[key] for r in runs["fixed"]], [r[key] for r in runs["glibc"]])
              for key in ("step_rate", "peak_rss_mib")}
    for side in runs:
        print(harness.describe(f"{side} step rate", stats[side]["step_rate"], " samples/s"))
        print(harness.describe(f"{side} peak RSS", stats[side]["peak_rss_mib"], " MiB"))
    print(f"fixed / glibc: step rate {ratios['step_rate']:.3f}, peak RSS {ratios['peak_rss_mib']:.3f}")
    session.write(steps=args.steps, overrides=args.overrides, thresholds_kib=SIDES, sides=stats,
                  ratio_fixed_over_glibc=ratios)
    return 0
