"""Faults on a multi-node Ray cluster inside this machine: the cluster (`FaultCluster`: a head and 1-CPU
worker nodes that can be added, drained and killed), a training run in a subprocess on it (`Run`: its
metrics as they are written, its Ray worker processes, waiting with a deadline) and `poll`.

Used by `raydl bench recovery` and the fault tests (tests/ray). The cluster runs in the calling process
(ray.cluster_utils.Cluster.add_node must run on the main thread); each Run's driver is this module in a subprocess:

    python -m raydl.bench.fault_cluster ADDRESS SUMMARY.json ENV_JSON [section.key=value ...]

Ray keeps its files under $RAY_TMPDIR: set it to a directory of your own, or ray.init() on this machine follows
/tmp/ray/ray_current_cluster into this cluster (and this cluster into another).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from raydl.bench.procs import cmdline, descendants


def poll(what: str, check: Callable[[], Any], deadline_s: float, describe: Callable[[], str] = lambda: "",
         every_s: float = 0.2):
    """check() until it returns something truthy; raise TimeoutError naming `what` after deadline_s."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if value := check():
            return value
        time.sleep(every_s)
    raise TimeoutError(f"{what} did not happen within {deadline_s:.0f} s\n{describe()}")


def train_workers(root: int | None = None) -> list[int]:
    """Live RayTrainWorker processes of this cluster: descendants of this process's raylets."""
    return sorted(p for p in descendants(root or os.getpid()) if cmdline(p).startswith("ray::RayTrainWorker"))


class FaultCluster:
    """A head (1 CPU: the driver, the Train controller and one worker) plus 1-CPU worker nodes."""

    def __init__(self):
        from ray.cluster_utils import Cluster

        os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"), exist_ok=True)   # Cluster() writes ray_current_cluster there and fails without it
        # No metrics: once a node is lost with no room for its placement-group bundle, Ray 2.60's GCS retries
        # the bundle in a loop without backoff (ray-project/ray#65007) and its scheduling metrics kept the
        # head's DashboardAgent ingesting at 100% of a second core; without them the survivors keep one core.
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "_system_config": {"enable_metrics_collection": False}})
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

    def shutdown(self) -> None:
        self.cluster.shutdown()


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
        # One machine: every local path is on every node, as NFS would be (a test may still set it false).
        sets = ["checkpoint.shared_local=true", "data.shared_local=true", *self.overrides, f"run.dir={self.run_dir}"]
        cmd = [sys.executable, "-m", "raydl.bench.fault_cluster", self.address, str(self.root / "summary.json"),
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


def driver(argv: list[str]) -> int:
    """A Run's process (argv: address, summary path, env as JSON, overrides): connect with `env` in the
    job's runtime_env (it reaches the controller and workers) and train."""
    import ray

    from raydl.driver.ray_trainer import ray_env, run_training
    from raydl.log import ray_log_level
    from raydl.overrides import load_config

    address, summary_path, extra, sets = argv[0], argv[1], json.loads(argv[2]), argv[3:]
    os.environ.update(extra)    # ray_env reads Ray's knobs from here
    cfg = load_config(None, sets)
    env = {**ray_env(cfg), **extra}
    os.environ.update(env)
    # As raydl's own connect to a cluster does (raydl.driver.ray_trainer.connect): Ray's INFO lines only with -v.
    ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True, logging_level=ray_log_level())
    summary = run_training(cfg, address=address)
    Path(summary_path).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(driver(sys.argv[1:]))
