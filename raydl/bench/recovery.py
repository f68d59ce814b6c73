"""raydl bench recovery: seconds from a fault to the next completed training step, raydl's vs Ray's defaults.

On a multi-node Ray cluster on this machine; also the steps each fault made training redo.

    raydl bench recovery                      # both faults x both settings, writes benchmarks/results/recovery-cpu.json
    raydl bench recovery --faults worker_kill --settings raydl
    raydl bench recovery --faults pp_worker_kill --out benchmarks/results/recovery-memory-cpu.json   # memory vs storage

Faults, injected from outside as real ones happen (tiny GPT, 2 workers on a 1-CPU head + one 1-CPU node):
  worker_kill   SIGKILL one RayTrainWorker process mid-interval (fixed 2 workers)
  node_loss     kill the worker node's raylet and everything on it, without notice (elastic 1..2 workers)
  pp_worker_kill  SIGKILL one worker of a pipeline run (pp=2, fixed 2 workers, checkpoint.every_steps=100,
                a record per step): Ray restarts the whole group
Settings (worker_kill, node_loss):
  raydl         raydl's defaults: worker start timeout 15 s, resize check 30 s, Train health check 0.5 s
  ray           Ray's defaults:   worker start timeout 60 s, resize check 60 s, Train health check 2 s
Settings (pp_worker_kill), both with raydl's timing defaults:
  memory        the restarted group reloads the last step from the state holder (checkpoint.memory_every_steps=1)
  storage       it reloads the last storage checkpoint, as before (checkpoint.memory_every_steps=0)
Measured per run: recovery_s = fault -> the first step the restarted worker group completes (step end time as
the worker recorded it; a step the old group had in flight and finished after the fault does not count);
progress_s = fault -> its first step past the last one completed before the fault (the redone steps
included); steps_redone and the restart record from summary.json.

The (fault, setting) pairs alternate for --repeats rounds (each run takes 1-2 minutes on 2 cores); medians
are reported. The cluster and the runs are raydl/bench/fault_cluster.py's. Ray keeps its files under
$RAY_TMPDIR (otherwise Ray follows /tmp/ray/ray_current_cluster into any other Ray on this machine): unset, a new directory of this benchmark's own.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.bench.fault_cluster import FaultCluster, Run
from raydl.bench.procs import kill

SETTINGS = {
    "raydl": {"overrides": [], "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    "ray": {"overrides": ["scaling.worker_start_timeout_s=60", "scaling.resize_check_s=60"],
            "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}},
    "memory": {"overrides": ["checkpoint.memory_every_steps=1"], "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    "storage": {"overrides": ["checkpoint.memory_every_steps=0"], "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
}
FAULT_SETTINGS = {"worker_kill": ("raydl", "ray"), "node_loss": ("raydl", "ray"), "pp_worker_kill": ("memory", "storage")}
FAULTS = tuple(FAULT_SETTINGS)
EVERY = 10          # checkpoint interval: the bound on steps redone
PIPELINE = ["parallel.pp_degree=2", "parallel.num_microbatches=2", "checkpoint.every_steps=100",
            "telemetry.report_every=1"]   # every step's record reaches metrics.jsonl: steps redone counted exactly


def run_config(data_dir: Path, steps: int, fault: str, setting: str) -> list[str]:
    workers = ["scaling.min_workers=2", "scaling.max_workers=2"] if fault != "node_loss" else \
        ["scaling.min_workers=1", "scaling.max_workers=2"]
    return [f"data.cache_dir={data_dir}", "data.builtin_samples=4096", f"train.max_steps={steps}",
            f"checkpoint.every_steps={EVERY}", "telemetry.report_every=5", "train.eval_batches=2",
            "telemetry.progress=false", "scaling.max_failures=3", *workers, *SETTINGS[setting]["overrides"],
            *(PIPELINE if fault == "pp_worker_kill" else [])]


def start_at_two_workers(root: Path, overrides: list[str], address: str, env: dict[str, str],
                         attempts: int = 3) -> Run:
    """A run whose first worker group has 2 workers. An elastic run started right after a node joined may start
    with 1 (Train's autoscaling coordinator refreshes its node view every 20 s) and grow only at the next resize
    check: start it again then, by which time the coordinator has seen the node."""
    for attempt in range(attempts):
        run = Run(root / f"try{attempt}", overrides, address, env=env).start()
        if run.wait_for("a first reported step", run.world_size, deadline_s=300) == 2:
            return run
        run.stop()
    raise RuntimeError(f"no run started with 2 workers in {attempts} attempts:\n{run.tail()}")


def measure(cluster: FaultCluster, work: Path, fault: str, setting: str, *, steps: int, at_step: int,
            rng: random.Random) -> dict[str, Any]:
    """One run with one fault, in a new directory under `work` (where the built-in data is cached)."""
    cluster.resize(1)
    root = Path(tempfile.mkdtemp(dir=work, prefix=f"{fault}-{setting}-"))
    run = start_at_two_workers(root, run_config(work / "data", steps, fault, setting), cluster.address,
                               SETTINGS[setting]["env"])
    try:
        run.wait_step(at_step, deadline_s=300)
        done_before = run.step()
        victim = rng.choice(run.workers(2))
        t_fault = time.time()
        if fault != "node_loss":
            kill(victim)
        else:
            cluster.remove(cluster.nodes[0], graceful=False)
        summary = run.finish(deadline_s=600)
    finally:
        run.stop()
    restart = summary["restarts"][0] if summary["restarts"] else {}
    after, progress = new_group_steps(run.records(), restart, done_before)
    return {"recovery_s": round(after["time"] - t_fault, 2), "progress_s": round(progress["time"] - t_fault, 2),
            "steps_redone": restart.get("steps_redone"), "fault_after_step": done_before, "restart": restart,
            "world_sizes": summary["world_sizes"], "load_avg_1m": round(os.getloadavg()[0], 2)}


def new_group_steps(records: list[dict[str, Any]], restart: dict[str, Any],
                    done_before: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the restarted worker group's first step record, its first past `done_before`). A step the old group had
    in flight when the fault hit can still end after it: that is not recovery. The new group starts at
    `resumed_at_step` + 1, and its records follow all of the old group's, so its first is the last with that step."""
    first = max(i for i, r in enumerate(records) if r["step"] == restart["resumed_at_step"] + 1)
    return records[first], next(r for r in records[first:] if r["step"] > done_before)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("recovery", __doc__)
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS),
                   help="Each fault runs with the settings of its own that are given (see above).")
    p.add_argument("--steps", type=int, default=120, help="Steps per run (the fault comes at --at-step).")
    p.add_argument("--at-step", type=int, default=33)
    args = harness.parse_args(p, argv)
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="raydl-recovery-")   # never another user's Ray
    session = harness.Session("recovery", args)
    work, rng = Path(tempfile.mkdtemp(prefix="raydl-bench-recovery-")), random.Random(0)
    cluster = FaultCluster()
    try:
        sides = {f"{fault}/{setting}": functools.partial(measure, cluster, work, fault, setting, steps=args.steps,
                                                         at_step=args.at_step, rng=rng)
                 for fault in args.faults for setting in args.settings if setting in FAULT_SETTINGS[fault]}
        runs = harness.alternate(sides, args.repeats)
    finally:
        cluster.shutdown()
    stats = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    for side, side_stats in stats.items():
        print(harness.describe(f"{side} recovery", side_stats["recovery_s"], " s"))
    session.write(steps=args.steps, at_step=args.at_step, checkpoint_every_steps=EVERY, pipeline=PIPELINE, settings=SETTINGS,
                  sides=stats, runs=runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
