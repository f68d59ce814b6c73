"""Fault-test harness: a multi-node Ray cluster on one machine, a raydl run in a subprocess, and the faults.

The cluster (`ray.cluster_utils.Cluster`, one 1-CPU raylet per node, so one Train worker per node) is driven
from the main thread (RAY_NOTES P8: add_node uses signals); `run_training` runs in a subprocess started by
`Run`, and the test injects faults from outside, as a real failure would happen:

    SIGKILL a RayTrainWorker process     (found as a descendant of this process: never another user's Ray)
    remove a node without notice         (Cluster.remove_node(allow_graceful=False))
    drain a node with a preemption notice (`ray drain-node ... --reason DRAIN_NODE_REASON_PREEMPTION`)

Every poll has a deadline; nothing sleeps blindly. The sample-id ledger (raydl/data/ledger.py,
RAYDL_LEDGER_DIR) reaches the workers through the job's runtime_env.

    python -m tests.ray.fault_harness ADDRESS LEDGER_DIR SUMMARY_JSON [--set k=v ...]   # what Run starts
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]


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


def open_files(pid: int) -> list[str]:
    fd_dir = Path("/proc") / str(pid) / "fd"
    out = []
    try:
        for fd in os.listdir(fd_dir):
            try:
                out.append(os.readlink(fd_dir / fd))
            except OSError:
                pass
    except OSError:
        pass
    return out


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
        while len(self.nodes) > extra:
            self.remove(self.nodes[-1], graceful=True)
        while len(self.nodes) < extra:
            self.add()
        self.cluster.wait_for_nodes()

    def drain(self, node, *, deadline_s: int = 20) -> None:
        """A spot-style preemption notice for `node`, as a cloud provider's autoscaler would send it."""
        cmd = [str(Path(sys.executable).parent / "ray"), "drain-node", "--address", self.address,
               "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
               "--reason-message", "fault test: spot preemption", "--deadline-remaining-seconds", str(deadline_s)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, f"ray drain-node failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"

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
    """One `run_training` in a subprocess on the cluster, with its run dir, ledger and log."""

    root: Path
    overrides: list[str]
    address: str
    proc: subprocess.Popen | None = None
    started: float = 0.0
    kills: list[dict[str, Any]] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger"

    @property
    def log(self) -> Path:
        return self.root / "driver.log"

    def start(self) -> "Run":
        self.ledger.mkdir(parents=True, exist_ok=True)
        sets = [*self.overrides, f"run.dir={self.run_dir}"]
        cmd = [sys.executable, "-m", "tests.ray.fault_harness", self.address, str(self.ledger),
               str(self.root / "summary.json"), *(a for s in sets for a in ("--set", s))]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        self.started = time.monotonic()
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
            raise AssertionError(f"the run exited early with {self.proc.returncode}:\n{self.tail()}")

    def wait_for(self, what: str, check: Callable[[], Any], deadline_s: float = 120, every_s: float = 0.2):
        def checked():
            self.alive()
            return check()
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
            raise AssertionError(f"the run did not finish within {deadline_s} s:\n{self.tail()}") from None
        assert rc == 0, f"the run failed with {rc}:\n{self.tail()}"
        return json.loads((self.root / "summary.json").read_text())

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints Ray has registered (its manager snapshot), oldest first."""
    try:
        data = json.loads((run_dir / "train" / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):   # not written yet, or being rewritten
        return []
    return sorted({int(r["checkpoint_dir_name"][len("step_"):].split(".")[0]) for r in data["checkpoint_results"]})


def reference_run(run_dir: Path, overrides: list[str], *, nproc: int = 2) -> dict[str, Any]:
    """The fault-free run: the same loop and process group under torchrun (no Ray: 15 s instead of ~60 s here).

    Bit-identical to a Ray run of the same layout (same loop, same gloo collectives, same seeds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raydl.worker", "--run-dir", str(run_dir), *(a for s in overrides for a in ("--set", s))]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if k != "RAYDL_LEDGER_DIR"})
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((run_dir / "summary.json").read_text())


# ------------------------------------------------------------------------------------------------- ledger
def committed_ids(ledger: Path) -> dict[int, list[int]]:
    """Epoch -> sample ids of the steps that count.

    Each worker-group attempt writes one ledger file per rank (header: start position, time, dp rank/size);
    pipeline ranks of one dp rank write the same ids, so one file per dp rank is read. An attempt's steps
    count up to the position the next attempt started from (the checkpoint it loaded); later ones were
    lost with the attempt and redone. The last attempt counts whole."""
    attempts = _attempts(ledger)
    ids: dict[int, list[int]] = {}
    for i, attempt in enumerate(attempts):
        limit = _pos(attempts[i + 1].start) if i + 1 < len(attempts) else (1 << 62, 0)
        for records in attempt.ranks.values():
            for r in records:
                if _pos(r) <= limit:
                    ids.setdefault(r["epoch"], []).extend(r["ids"])
    return ids


def attempt_starts(ledger: Path) -> list[tuple[int, int, int]]:
    """(epoch, offset, dp_size) each attempt started at, in time order."""
    return [(*_pos(a.start), a.dp_size) for a in _attempts(ledger)]


def _pos(r: dict) -> tuple[int, int]:
    return r["epoch"], r["offset"]


@dataclass
class Attempt:
    start: dict
    t: float
    dp_size: int
    ranks: dict[int, list[dict]] = field(default_factory=dict)   # dp rank -> its step records


def _attempts(ledger: Path) -> list[Attempt]:
    """Ledger files grouped into worker-group attempts, in start-time order.

    Ranks of one attempt open their loaders within a second of each other (after a collective
    checkpoint load); attempts are several seconds apart (a restart starts new processes)."""
    files = []
    for f in ledger.glob("ledger-*.jsonl"):
        lines = []
        for line in f.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:   # the last line of a SIGKILLed writer may be cut short
                pass
        files.append((lines[0], lines[1:]))
    attempts: list[Attempt] = []
    for header, records in sorted(files, key=lambda hf: hf[0]["t"]):
        last = attempts[-1] if attempts else None
        if (last is None or header["t"] - last.t > 3.0 or header["start"] != last.start
                or header["dp_size"] != last.dp_size):
            last = Attempt(header["start"], header["t"], header["dp_size"])
            attempts.append(last)
        last.ranks.setdefault(header["dp_rank"], records)   # pipeline ranks of a dp rank repeat its ids
    return attempts


def epoch_ids(data_dir: Path) -> list[int]:
    import pyarrow.parquet as pq

    return sorted(i for f in data_dir.glob("train-*.parquet") for i in pq.read_table(f)["id"].to_pylist())


# ------------------------------------------------------------------------------------------- driver side
def _main(argv: list[str]) -> int:
    """The run's driver: connect with the ledger in the job's runtime_env, then plain `run_training`."""
    import ray

    from raydl.overrides import load_config
    from raydl.train.trainer import ray_env, run_training

    address, ledger, summary_path, rest = argv[0], argv[1], argv[2], argv[3:]
    cfg = load_config(None, [rest[i + 1] for i in range(0, len(rest), 2)])
    env = {**ray_env(cfg), "RAYDL_LEDGER_DIR": ledger}
    os.environ.update(env)
    ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
    summary = run_training(cfg, address=address)
    Path(summary_path).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
