"""raydl bench recovery: seconds from a fault to the next completed training step, on a multi-node Ray
cluster on this machine, with raydl's defaults and with Ray's defaults; and the steps redone.

    raydl bench recovery                      # both faults x both settings, writes benchmarks/results/recovery-cpu.json
    raydl bench recovery --faults worker_kill --settings raydl

Faults, injected from outside as real ones happen (tiny GPT, 2 workers on a 1-CPU head + one 1-CPU node):
  worker_kill   SIGKILL one RayTrainWorker process mid-interval (fixed 2 workers)
  node_loss     kill the worker node's raylet and everything on it, without notice (elastic 1..2 workers)
Settings:
  raydl         raydl's defaults: worker start timeout 15 s, resize check 30 s, Train health check 0.5 s
  ray           Ray's defaults:   worker start timeout 60 s, resize check 60 s, Train health check 2 s
Measured per run: recovery_s = fault -> the first step any worker group completes after it (step end time as
the worker recorded it); progress_s = fault -> the first step past the last one completed before the fault
(the redone steps included); steps_redone and the restart record from summary.json.

The cluster (`ray.cluster_utils.Cluster`) runs in this process (RAY_NOTES P8: add_node needs the main thread);
each training run is `run_training` in a subprocess (`python -m raydl.bench.recovery --driver ...`). Ray
keeps its files under $RAY_TMPDIR (RAY_NOTES P9): set it to a directory of your own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raydl.bench.common import machine, write_result

SETTINGS = {
    "raydl": {"overrides": [], "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}},
    "ray": {"overrides": ["scaling.worker_start_timeout_s=60", "scaling.resize_check_s=60"],
            "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}},
}
FAULTS = ("worker_kill", "node_loss")
EVERY = 10          # checkpoint interval: the bound on steps redone


# ---------------------------------------------------------------------------------------------- processes
def poll(what: str, check: Callable[[], Any], deadline_s: float, describe: Callable[[], str] = lambda: "",
         every_s: float = 0.2):
    """check() until it returns something truthy; raise TimeoutError naming `what` after deadline_s."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if value := check():
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {deadline_s:.0f} s\n{describe()}")


# ---------------------------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def train_workers(root: int | None = None) -> list[int]:
    """Live RayTrainWorker processes of this cluster: descendants of this process's raylets."""
    return sorted(p for p in descendants(root or os.getpid()) if cmdline(p).startswith("ray::RayTrainWorker"))


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# ------------------------------------------------------------------------------------------------ cluster
class FaultCluster:
    """A head (1 CPU: the driver, the Train controller and one worker) plus 1-CPU worker nodes."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)   # RAY_NOTES P9
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        self.nodes: list = []

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self):
        node = self.cluster.add_node(num_cpus=1)
        self.nodes.append(node)
        return node

    def remove(self, node, *, graceful: bool = False) -> None:
        """Kill the node's raylet and everything on it (graceful=False: as a crashed machine)."""
        self.nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=graceful)

    def resize(self, extra: int) -> None:
        """`extra` worker nodes besides the head, waiting until the GCS lists them alive."""
        for node in [n for n in self.nodes if n.all_processes["raylet"][0].process.poll() is not None]:
            self.remove(node)   # a drained node's raylet exits by itself after its deadline
        while len(self.nodes) > extra:
            self.remove(self.nodes[-1], graceful=True)
        while len(self.nodes) < extra:
            self.add()
        self.cluster.wait_for_nodes()

    def drain(self, node, *, deadline_s: int = 20) -> None:
        """A spot-style preemption notice for `node`, as a cloud provider's autoscaler would send it."""
        cmd = [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", self.address,
               "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
               "--reason-message", "raydl fault injection: spot preemption", "--deadline-remaining-seconds", str(deadline_s)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if p.returncode:
            raise RuntimeError(f"ray drain-node failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")

    def node_of(self, pid: int):
        """The worker node whose raylet is an ancestor of `pid` (None: the head)."""
        for node in self.nodes:
            raylet = node.all_processes["raylet"][0].process.pid
            if pid in descendants(raylet):
                return node
        return None

    def shutdown(self) -> None:
        self.cluster.shutdown()


# ---------------------------------------------------------------------------------------------------- run
@dataclass
class Run:
    """One `run_training` in a subprocess on the cluster, with its run dir and log.

    env: extra env vars for the driver, the Train controller and every worker (the job's runtime_env)."""

    root: Path
    overrides: list[str]
    address: str
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "driver.log"

    def start(self) -> "Run":
        self.root.mkdir(parents=True, exist_ok=True)
        sets = [*self.overrides, f"run.dir={self.run_dir}"]
        cmd = [sys.executable, "-m", "raydl.bench.recovery", "--driver", self.address, str(self.root / "summary.json"),
               json.dumps(self.env), *sets]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        return self

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:   # a line being written right now
                pass
        return out

    def step(self) -> int:
        records = self.records()
        return records[-1]["step"] if records else 0

    def world_size(self) -> int:
        records = self.records()
        return records[-1]["world_size"] if records else 0

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the run exited early with {self.proc.returncode}:\n{self.tail()}")

    def wait_for(self, what: str, check: Callable[[], Any], deadline_s: float = 120, every_s: float = 0.2):
        def checked():
            if value := check():   # before alive(): a fast run may have met the condition and finished
                return value
            self.alive()
        return poll(what, checked, deadline_s, self.tail, every_s)

    def wait_step(self, step: int, deadline_s: float = 120) -> int:
        return self.wait_for(f"step {step}", lambda: self.step() >= step and self.step(), deadline_s)

    def workers(self, count: int, deadline_s: float = 120) -> list[int]:
        return self.wait_for(f"{count} RayTrainWorker processes",
                             lambda: len(w := train_workers()) == count and w, deadline_s)

    def finish(self, deadline_s: float = 300) -> dict[str, Any]:
        try:
            rc = self.proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise RuntimeError(f"the run did not finish within {deadline_s} s:\n{self.tail()}") from None
        if rc:
            raise RuntimeError(f"the run failed with {rc}:\n{self.tail()}")
        return json.loads((self.root / "summary.json").read_text())

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ------------------------------------------------------------------------------------------------- bench
def run_config(data_dir: Path, steps: int, fault: str, setting: str) -> list[str]:
    workers = ["scaling.min_workers=2", "scaling.max_workers=2"] if fault == "worker_kill" else \
        ["scaling.min_workers=1", "scaling.max_workers=2"]
    return [f"data.cache_dir={data_dir}", "data.builtin_samples=4096", f"train.max_steps={steps}",
            f"checkpoint.every_steps={EVERY}", "telemetry.report_every=5", "train.eval_batches=2",
            "telemetry.progress=false", "scaling.max_failures=3", *workers, *SETTINGS[setting]["overrides"]]


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


def measure(cluster: FaultCluster, root: Path, fault: str, setting: str, *, steps: int, at_step: int,
            rng: random.Random) -> dict[str, Any]:
    cluster.resize(1)
    run = start_at_two_workers(root, run_config(root.parent / "data", steps, fault, setting), cluster.address,
                               SETTINGS[setting]["env"])
    try:
        run.wait_step(at_step, deadline_s=300)
        done_before = run.step()
        victim = rng.choice(run.workers(2))
        t_fault = time.time()
        if fault == "worker_kill":
            kill(victim)
        else:
            cluster.remove(cluster.nodes[0], graceful=False)
        after = run.wait_for("a step after the fault", lambda: [r for r in run.records() if r["time"] > t_fault],
                             deadline_s=400)
        progress = run.wait_for("progress past the fault",
                                lambda: [r for r in run.records() if r["time"] > t_fault and r["step"] > done_before],
                                deadline_s=400)
        summary = run.finish(deadline_s=600)
    finally:
        run.stop()
    restart = summary["restarts"][0] if summary["restarts"] else {}
    result = {"fault": fault, "settings": setting, "recovery_s": round(after[0]["time"] - t_fault, 2),
              "progress_s": round(progress[0]["time"] - t_fault, 2), "steps_redone": restart.get("steps_redone"),
              "checkpoint_every_steps": EVERY, "fault_after_step": done_before, "restart": restart,
              "world_sizes": summary["world_sizes"], "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(f"{fault:12s} {setting:6s} recovery {result['recovery_s']:6.1f} s  progress {result['progress_s']:6.1f} s  "
          f"steps redone {result['steps_redone']}  (load {result['load_avg_1m']})", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        return _driver(argv[1:])
    p = argparse.ArgumentParser(prog="raydl bench recovery", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=120, help="Steps per run (the fault comes at --at-step).")
    p.add_argument("--at-step", type=int, default=33)
    p.add_argument("--out", default="benchmarks/results/recovery-cpu.json")
    args = p.parse_args(argv)
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="raydl-recovery-")   # never another user's Ray
    work = Path(tempfile.mkdtemp(prefix="raydl-bench-recovery-"))
    info, rng, results = machine(), random.Random(0), []
    cluster = FaultCluster()
    try:
        for i in range(args.repeats):
            for fault in args.faults:
                for setting in args.settings:
                    results.append(measure(cluster, work / f"{fault}-{setting}-{i}", fault, setting,
                                           steps=args.steps, at_step=args.at_step, rng=rng))
    finally:
        cluster.shutdown()
    write_result(args.out, {"benchmark": "recovery", "machine": info, "steps": args.steps, "at_step": args.at_step,
                            "settings": SETTINGS, "results": results, "median_recovery_s": _medians(results)})
    return 0


def _medians(results: list[dict[str, Any]]) -> dict[str, float]:
    keys = sorted({(r["fault"], r["settings"]) for r in results})
    return {f"{f}/{s}": statistics.median(r["recovery_s"] for r in results if (r["fault"], r["settings"]) == (f, s))
            for f, s in keys}


def _driver(argv: list[str]) -> int:
    """One run's driver: connect with `env` in the job's runtime_env (it reaches the controller and workers)."""
    import ray

    from raydl.overrides import load_config
    from raydl.driver.ray_trainer import ray_env, run_training

    address, summary_path, extra, sets = argv[0], argv[1], json.loads(argv[2]), argv[3:]
    os.environ.update(extra)    # ray_env reads Ray's knobs from here
    cfg = load_config(None, sets)
    env = {**ray_env(cfg), **extra}
    os.environ.update(env)
    ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    summary = run_training(cfg, address=address)
    Path(summary_path).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
