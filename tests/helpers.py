"""What several test files need: the sample-id ledger read back, gloo process groups (spawned here or under
torchrun) and stopping processes.

Waiting with a deadline and signalling a process are raydl's own, shared with the benchmarks:
raydl.bench.fault_cluster.poll and raydl.bench.procs.kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raydl.bench.fault_cluster import poll
from raydl.bench.procs import free_port, kill

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- ledger
@dataclass
class LoaderLog:
    """One loader's ledger file (raydl/data/ledger.py) as read back: its header and a record per step."""
    pid: int
    header: dict
    steps: list[dict]


def read_ledger(directory: Path) -> list[LoaderLog]:
    """Every ledger file in `directory` (a run's debug.ledger_dir), in the order the loaders started."""
    logs = []
    for path in directory.glob("ledger-*.jsonl"):
        header, *steps = _read_jsonl(path)
        logs.append(LoaderLog(int(path.name.split("-")[1]), header, steps))
    return sorted(logs, key=lambda log: log.header["t"])


def _read_jsonl(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:   # the last line of a SIGKILLed writer may be cut short
            pass
    return lines


@dataclass
class Attempt:
    """One worker group: where it started, its dp size, and each dp rank's step records."""
    start: dict             # {"epoch", "offset"}
    t: float
    dp_size: int
    ranks: dict[int, list[dict]] = field(default_factory=dict)


def attempts(directory: Path) -> list[Attempt]:
    """Ledger files grouped into worker-group attempts, in start-time order.

    Attempts follow each other. A file joins the attempt before it when it starts at the same
    position with the same dp size, unless its dp rank is already there and it started more than
    3 s later: pipeline ranks of one dp rank open their loaders together, a restart starts new
    processes seconds later. A new dp rank joins however late it came (a loaded machine)."""
    grouped: list[Attempt] = []
    for log in read_ledger(directory):
        last = grouped[-1] if grouped else None
        repeat = last is not None and log.header["dp_rank"] in last.ranks and log.header["t"] - last.t > 3.0
        if (last is None or repeat or log.header["start"] != last.start
                or log.header["dp_size"] != last.dp_size):
            last = Attempt(log.header["start"], log.header["t"], log.header["dp_size"])
            grouped.append(last)
        last.ranks.setdefault(log.header["dp_rank"], log.steps)   # pipeline ranks of one dp rank repeat it
    return grouped


def committed_ids(directory: Path) -> dict[int, list[int]]:
    """Epoch -> sample ids of the steps that count.

    Each attempt writes one ledger file per rank; pipeline ranks of one dp rank write the same ids, so
    one file per dp rank is read. An attempt's steps count up to the position the next attempt started
    from (the checkpoint it loaded); later ones were lost with the attempt and redone. The last attempt
    counts whole."""
    found = attempts(directory)
    ids: dict[int, list[int]] = {}
    for i, attempt in enumerate(found):
        limit = _position(found[i + 1].start) if i + 1 < len(found) else (1 << 62, 0)
        for steps in attempt.ranks.values():
            for step in steps:
                if _position(step) <= limit:
                    ids.setdefault(step["epoch"], []).extend(step["ids"])
    return ids


def _position(record: dict) -> tuple[int, int]:
    return record["epoch"], record["offset"]


def epoch_ids(data_dir: Path) -> list[int]:
    """The sample ids of one epoch: every row of the dataset's train shards, sorted."""
    import pyarrow.parquet as pq

    return sorted(i for f in data_dir.glob("train-*.parquet") for i in pq.read_table(f)["id"].to_pylist())


# ------------------------------------------------------------------------------------------------- gloo
def _gloo_entry(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():   # the code under test may have closed it itself
            dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, *args) in `world_size` spawned processes with a gloo group.

    fn must be importable (module level); results go through files in a tmp dir.
    """
    mp.start_processes(_gloo_entry, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       start_method="spawn", join=True)


def torchrun_worker(nproc: int, run_dir: Path, overrides: list[str], *, timeout_s: float,
                    resume: Path | None = None) -> subprocess.CompletedProcess:
    """raydl's per-worker loop (raydl.worker) under torchrun: `nproc` gloo ranks, no Ray; `resume`: a run
    directory or checkpoint to start from (a changed config needs a new run directory).

    The ranks inherit this process's env (OMP_NUM_THREADS as conftest.py set it), as Ray's workers do."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raydl.worker", "--run-dir", str(run_dir), *(a for s in overrides for a in ("--set", s)),
           *(["--resume", str(resume)] if resume else [])]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)


# ------------------------------------------------------------------------------------------------- processes
def stop_processes(pids: list[int], grace_s: float = 15) -> None:
    """SIGTERM each of `pids`, then SIGKILL those still alive after `grace_s`."""
    for pid in pids:
        kill(pid, signal.SIGTERM)
    try:
        poll(f"{len(pids)} processes exiting on SIGTERM", lambda: not any(kill(pid, 0) for pid in pids), grace_s,
             every_s=0.5)
    except TimeoutError:
        for pid in pids:
            kill(pid, signal.SIGKILL)
