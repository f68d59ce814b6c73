"""raydl bench recovery: what a fault costs a run: the stall, the steps redone, the samples lost or repeated,
and the time until the run is back at full size, for the two recovery paths side by side.

On a multi-node Ray cluster on this machine.

    raydl bench recovery                      # every fault with its settings, writes benchmarks/results/recovery-cpu.json
    raydl bench recovery --faults worker_kill none --settings raydl survivors --out benchmarks/results/recovery-survivors-cpu.json
    raydl bench recovery --faults pp_worker_kill --out benchmarks/results/recovery-memory-cpu.json   # memory vs storage

Faults, injected from outside as real ones happen (tiny GPT, 2 workers on a 1-CPU head + one 1-CPU node):
  worker_kill   SIGKILL one RayTrainWorker process mid-interval (fixed 2 workers)
  node_loss     kill the worker node's raylet and everything on it, without notice (elastic 1..2 workers); a
                new node comes back once the run has trained a step at the smaller size
  pp_worker_kill  SIGKILL one worker of a pipeline run (pp=2, fixed 2 workers, checkpoint.every_steps=100,
                a record per step): Ray restarts the whole group
  none          no fault: the default run's config (its report and checkpoint intervals), 2 workers, to time the
                steady-state step of each path (step_s: the median after the first fifth of the steps)
Settings (each fault runs with those of its own that are given: FAULT_SETTINGS):
  raydl         full restart (scaling.survivors=off) with raydl's defaults: worker start timeout 15 s, resize
                check 30 s, Train health check 0.5 s
  ray           full restart with Ray's defaults: worker start timeout 60 s, resize check 60 s, Train health check 2 s
  survivors     the survivors path (scaling.survivors=on, raydl.train.survivors): the other worker goes on,
                Ray's replacement copies it; after a node loss the replacement waits for the new node
                (raydl.driver.scaling_policy.SurvivorsElasticPolicy).
  memory        pp_worker_kill: the restarted group reloads the last step from the state holder
                (checkpoint.memory_every_steps=1)
  storage       pp_worker_kill: it reloads the last storage checkpoint, as before (checkpoint.memory_every_steps=0)
Measured per run (step end times as the workers recorded them):
  stall_s        fault -> the first step of the workers that recovered: the restarted group's first, or the
                 survivors' first at the smaller size (the step in flight, finished after the fault, does not count);
  progress_s     fault -> the first step past the last one completed before the fault (redone steps included);
  full_size_s    fault -> the first step at 2 workers again (node_loss: after the node came back, node_back_s);
  steps_redone   steps trained twice (sample-id ledger: steps a loader handed out past where its successor began);
  samples_lost, samples_repeated   over the run's epochs, from the ledger: both must be 0;
  restarts       worker-group restarts (summary.json);
  step_s_before  the median step time at 2 workers before the fault: the steady-state cost of each path.

The (fault, setting) pairs alternate for --repeats rounds (each run takes 1-2 minutes on 2 cores); medians
are reported. The cluster and the runs are raydl/bench/fault_cluster.py's. Ray keeps its files under
$RAY_TMPDIR (otherwise Ray follows /tmp/ray/ray_current_cluster into any other Ray on this machine): unset, a new directory of this benchmark's own.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.bench.fault_cluster import FaultCluster, Run
from raydl.bench.procs import kill
from raydl.data.dataset import resolve_path
from raydl.data.ledger_read import lost_and_repeated, steps_redone
from raydl.models.choice import choose_model
from raydl.overrides import load_config

SETTINGS = {
    "raydl": {"overrides": ["scaling.survivors=off"], "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    "ray": {"overrides": ["scaling.survivors=off", "scaling.worker_start_timeout_s=60", "scaling.resize_check_s=60"],
            "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}},
    "survivors": {"overrides": ["scaling.survivors=on"], "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    "memory": {"overrides": ["scaling.survivors=off", "checkpoint.memory_every_steps=1"],
               "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    "storage": {"overrides": ["scaling.survivors=off", "checkpoint.memory_every_steps=0"],
                "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
}
FAULT_SETTINGS = {"worker_kill": ("raydl", "ray", "survivors"), "node_loss": ("raydl", "ray", "survivors"),
                  "pp_worker_kill": ("memory", "storage"), "none": ("raydl", "survivors")}
FAULTS = tuple(FAULT_SETTINGS)
EVERY = 10          # checkpoint interval: the bound on steps redone
PIPELINE = ["parallel.pp_degree=2", "parallel.num_microbatches=2", "checkpoint.every_steps=100",
            "telemetry.report_every=1"]   # every step's record reaches metrics.jsonl: steps redone counted exactly


def run_config(data_dir: Path, steps: int, fault: str, setting: str, ledger: Path,
               extra: tuple[str, ...] = ()) -> list[str]:
    """A run's overrides: the fault's, the setting's, then `extra` (--set), the same on every side."""
    if fault == "none":
        return [f"data.cache_dir={data_dir}", f"train.max_steps={steps}", "telemetry.progress=false",
                *SETTINGS[setting]["overrides"], *extra]
    workers = ["scaling.min_workers=1", "scaling.max_workers=2"] if fault == "node_loss" else \
        ["scaling.min_workers=2", "scaling.max_workers=2"]
    return [f"data.cache_dir={data_dir}", "data.builtin_samples=4096", f"train.max_steps={steps}",
            f"checkpoint.every_steps={EVERY}", "telemetry.report_every=5", "train.eval_batches=2",
            "telemetry.progress=false", "scaling.max_failures=3", f"debug.ledger_dir={ledger}", *workers,
            *SETTINGS[setting]["overrides"], *(PIPELINE if fault == "pp_worker_kill" else []), *extra]


def start_at_two_workers(root: Path, overrides: list[str], address: str, env: dict[str, str], ledger: Path,
                         attempts: int = 3) -> Run:
    """A run whose first worker group has 2 workers. An elastic run started right after a node joined may start
    with 1 (Train's autoscaling coordinator refreshes its node view every 20 s) and grow only at the next resize
    check: start it again then, by which time the coordinator has seen the node."""
    for attempt in range(attempts):
        shutil.rmtree(ledger, ignore_errors=True)   # the sample ids of this attempt's run only
        ledger.mkdir()
        run = Run(root / f"try{attempt}", overrides, address, env=env).start()
        if run.wait_for("a first reported step", run.world_size, deadline_s=300) == 2:
            return run
        run.stop()
    raise RuntimeError(f"no run started with 2 workers in {attempts} attempts:\n{run.tail()}")


def measure(cluster: FaultCluster, work: Path, fault: str, setting: str, *, steps: int, at_step: int,
            rng: random.Random, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run with one fault, in a new directory under `work` (where the built-in data is cached)."""
    cluster.resize(1)
    root = Path(tempfile.mkdtemp(dir=work, prefix=f"{fault}-{setting}-"))
    overrides = run_config(work / "data", steps, fault, setting, root / "ledger", extra)
    run = start_at_two_workers(root, overrides, cluster.address, SETTINGS[setting]["env"], root / "ledger")
    if fault == "none":
        return steady(run)
    try:
        run.wait_step(at_step, deadline_s=300)
        done_before = run.step()
        victim = rng.choice(run.workers(2))
        t_fault, node_back = time.time(), None
        if fault != "node_loss":
            kill(victim)
        else:
            cluster.remove(cluster.nodes[0], graceful=False)
            run.wait_for("a step at the smaller size", lambda: any(
                r["time"] > t_fault and r["world_size"] < 2 for r in run.records()), deadline_s=300)
            cluster.add()   # capacity returns: a restart grows onto it, the survivors' replacement is placed on it
            node_back = round(time.time() - t_fault, 2)
        summary = run.finish(deadline_s=600)
    finally:
        run.stop()
    records, restart = run.records(), (summary["restarts"][0] if summary["restarts"] else {})
    after, progress = after_fault(records, restart, t_fault, done_before)
    full = back_at_full_size(records, after)
    lost, repeated = lost_and_repeated(root / "ledger", data_dir(overrides))
    before = [r["step_s"] for r in records if r["time"] < t_fault and r["world_size"] == 2][5:]   # warm
    return {"stall_s": round(after["time"] - t_fault, 2), "progress_s": round(progress["time"] - t_fault, 2),
            "full_size_s": round(full["time"] - t_fault, 2) if full else None, "node_back_s": node_back,
            "steps_redone": steps_redone(root / "ledger"), "samples_lost": lost, "samples_repeated": repeated,
            "restarts": len(summary["restarts"]), "step_s_before": round(statistics.median(before), 4),
            "fault_after_step": done_before, "restart": restart, "world_sizes": summary["world_sizes"],
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def steady(run: Run) -> dict[str, Any]:
    try:
        run.finish(deadline_s=900)
    finally:
        run.stop()
    records = run.records()
    warm = records[len(records) // 5:]
    return {"step_s": round(statistics.median(r["step_s"] for r in warm), 4),
            "samples_per_s": round(sum(r["samples"] for r in warm) / (warm[-1]["time"] - warm[0]["time"]), 1),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def data_dir(overrides: list[str]) -> Path:
    cfg = load_config(None, overrides)
    return Path(resolve_path(cfg, choose_model(cfg.model).spec.task))


def back_at_full_size(records: list[dict[str, Any]], after: dict[str, Any]) -> dict[str, Any] | None:
    """The first step at 2 workers from `after` (the first step after the fault) on; None if the run ended smaller."""
    return next((r for r in records if r["time"] >= after["time"] and r["world_size"] == 2), None)


def after_fault(records: list[dict[str, Any]], restart: dict[str, Any], t_fault: float,
                done_before: int, workers: int = 2) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the first step after the fault by the workers that recovered: the restarted group's first, or without a
    restart the survivors' first at the smaller size; the first step from there past `done_before`, the last
    step completed before the fault). The step in flight can still end after the fault, in the old group or,
    when its all-reduce had completed, on the survivors: it ends no stall."""
    after = new_group_steps(records, restart) if restart else \
        next(r for r in records if r["time"] > t_fault and r["world_size"] < workers)
    return after, next(r for r in records if r["time"] >= after["time"] and r["step"] > done_before)


def new_group_steps(records: list[dict[str, Any]], restart: dict[str, Any]) -> dict[str, Any]:
    """The restarted worker group's first step record. A step the old group had in flight when the fault hit can
    still end after it: that is not recovery. The new group starts at `resumed_at_step` + 1, and its records
    follow all of the old group's, so its first is the last with that step."""
    return records[max(i for i, r in enumerate(records) if r["step"] == restart["resumed_at_step"] + 1)]


def write(session: harness.Session, args, runs: dict[str, list[dict[str, Any]]]) -> None:
    stats = {side: harness.summarize(side_runs) for side, side_runs in runs.items()}
    for side, side_stats in stats.items():
        if "stall_s" in side_stats:
            print(harness.describe(f"{side} stall", side_stats["stall_s"], " s"))
    overhead = {}   # each round's two runs ran back to back
    for fault, key in (("worker_kill", "step_s_before"), ("none", "step_s")):
        if f"{fault}/survivors" in runs and f"{fault}/raydl" in runs:
            overhead[fault] = harness.paired_ratios([r[key] for r in runs[f"{fault}/survivors"]],
                                                    [r[key] for r in runs[f"{fault}/raydl"]])
            print(harness.describe(f"{fault}: survivors / full-restart step time", overhead[fault]))
    throughput = {}   # the steady cost as issue 38 states it: wall-clock samples/s after the first fifth
    if "none/survivors" in runs and "none/raydl" in runs:
        throughput["none"] = harness.paired_ratios([r["samples_per_s"] for r in runs["none/survivors"]],
                                                   [r["samples_per_s"] for r in runs["none/raydl"]])
        print(harness.describe("none: survivors / full-restart samples/s", throughput["none"]))
    session.write(steps=args.steps, at_step=args.at_step, checkpoint_every_steps=EVERY, settings=SETTINGS,
                  rounds_done=min(len(side_runs) for side_runs in runs.values()), sides=stats,
                  step_time_ratio_survivors_over_restart=overhead,
                  samples_per_s_ratio_survivors_over_restart=throughput, runs=runs)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("recovery", __doc__)
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS),
                   help="Each fault runs with the settings of its own that are given (see above).")
    p.add_argument("--steps", type=int, default=240, help="Steps per run (the fault comes at --at-step); enough "
                   "for the survivors' replacement to join before the end.")
    p.add_argument("--at-step", type=int, default=33)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="A config override for every run of every side (e.g. model.size=small: the steady cost "
                        "of --faults none on longer steps); checked before anything starts.")
    args = harness.parse_args(p, argv)
    load_config(None, args.overrides)   # a bad override fails here, not in the first run
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="raydl-recovery-")   # never another user's Ray
    session = harness.Session("recovery", args)
    work, rng = Path(tempfile.mkdtemp(prefix="raydl-bench-recovery-")), random.Random(0)
    cluster = FaultCluster()
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        sides = {f"{fault}/{setting}": functools.partial(measure, cluster, work, fault, setting, steps=args.steps,
                                                         at_step=args.at_step, rng=rng,
                                                         extra=tuple(args.overrides))
                 for fault in args.faults for setting in args.settings if setting in FAULT_SETTINGS[fault]}
        for _ in range(args.repeats):   # written after every round: a run takes minutes on a busy machine
            for side, side_runs in harness.alternate(sides, 1).items():
                runs.setdefault(side, []).extend(side_runs)
            write(session, args, runs)
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
