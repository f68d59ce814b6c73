"""Fault-test helpers on top of raydl.bench.fault_cluster (cluster, run subprocess, process faults): the sample-id
ledger, Ray's registered checkpoints, open files, and the fault-free reference run.

The ledger (raydl/data/ledger.py, debug.ledger_dir) reaches the workers inside the job's config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydl.bench.fault_cluster import Run

REPO = Path(__file__).resolve().parents[2]


def ledger(run: Run) -> Path:
    return run.root / "ledger"


def ledger_run(root: Path, overrides: list[str], address: str) -> Run:
    (root / "ledger").mkdir(parents=True, exist_ok=True)
    return Run(root, [*overrides, f"debug.ledger_dir={root / 'ledger'}"], address)


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



def preempted_checkpoints(run_dir: Path) -> list[int]:
    """Steps of registered checkpoints that raydl saved at a preemption notice (their metrics say so)."""
    try:
        data = json.loads((run_dir / "train" / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):
        return []
    return sorted({r["metrics"]["step"] for r in data["checkpoint_results"] if r["metrics"].get("preempted")})


def checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints Ray has registered (its manager snapshot), oldest first."""
    try:
        data = json.loads((run_dir / "train" / "checkpoint_manager_snapshot.json").read_text())
    except (OSError, ValueError):   # not written yet, or being rewritten
        return []
    return sorted({int(r["checkpoint_dir_name"][len("step_"):].split(".")[0]) for r in data["checkpoint_results"]})


def reference_run(run_dir: Path, overrides: list[str], *, nproc: int = 2) -> dict[str, Any]:
    """The fault-free run (summary + per-step "losses"): the same loop and process group under torchrun (no Ray: 15 s instead of ~60 s here).

    Bit-identical to a Ray run of the same layout (same loop, same gloo collectives, same seeds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "raydl.worker", "--run-dir", str(run_dir), *(a for s in overrides for a in ("--set", s))]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["losses"] = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    return summary


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
