"""Fault-test helpers on top of raydl.bench.fault_cluster (cluster, run subprocess, process faults): a run
with the sample-id ledger on (read back with tests/helpers.py), Ray's registered checkpoints, open files, and
the fault-free reference run.

The ledger (raydl/data/ledger.py, debug.ledger_dir) reaches the workers inside the job's config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from raydl.bench.fault_cluster import Run
from tests.helpers import forked_worker


def ledger(run: Run) -> Path:
    return run.root / "ledger"


def ledger_run(root: Path, overrides: list[str], address: str) -> Run:
    (root / "ledger").mkdir(parents=True, exist_ok=True)
    return Run(root, [*overrides, f"debug.ledger_dir={root / 'ledger'}"], address)


def held(run: Run, ranks: int, deadline_s: float = 240) -> None:
    """Wait until `ranks` workers hold at debug.hold_at_step (raydl/train/hold.py): the run is there, its
    checkpoint reported, and stays there until the cluster changes or `release`."""
    run.wait_for(f"{ranks} workers held", lambda: len(list(ledger(run).glob("held-*"))) >= ranks, deadline_s)


def release(run: Run) -> None:
    """Let held workers (and any that reach the hold step again after a restart) go on."""
    (ledger(run) / "release").touch()


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


def _registered(run_dir: Path) -> list[dict]:
    """The checkpoints Ray has registered, from its manager snapshot."""
    try:
        return json.loads((run_dir / "train" / "checkpoint_manager_snapshot.json").read_text())["checkpoint_results"]
    except (OSError, ValueError):   # not written yet, or being rewritten
        return []


def preempted_checkpoints(run_dir: Path) -> list[int]:
    """Steps of registered checkpoints that raydl saved at a preemption notice (their metrics say so)."""
    return sorted({r["metrics"]["step"] for r in _registered(run_dir) if r["metrics"].get("preempted")})


def checkpoints(run_dir: Path) -> list[int]:
    """Steps of the checkpoints Ray has registered, oldest first."""
    return sorted({int(r["checkpoint_dir_name"][len("step_"):].split(".")[0]) for r in _registered(run_dir)})


def newest_registered(run_dir: Path) -> int:
    """The step of the newest checkpoint Ray has registered (0 for none): read just before a fault, the oldest step
    the run may resume from (Train's controller registers a report at its next poll, so the last reported step's
    checkpoint may not be among them yet)."""
    return (checkpoints(run_dir) or [0])[-1]


NO_CHECKPOINT_BEFORE_THE_END = 10**6


def reference_run(run_dir: Path, overrides: list[str], *, nproc: int = 2) -> dict[str, Any]:
    """The fault-free run (summary + per-step "losses"): the same loop and process group in forked gloo ranks (no Ray,
    no process starts: the ranks fork from tests/helpers.py's server, which imported torch and raydl once).

    Bit-identical to a Ray run of the same layout (same loop, same gloo collectives, same seeds). It saves no checkpoint
    before its last step: saving changes no loss, eval or sample (checked: 120 steps, every 5 or never, the same to the
    bit) and took half its time (24 s of a 600-step reference's 78)."""
    forked_worker(nproc, run_dir, [*overrides, f"checkpoint.every_steps={NO_CHECKPOINT_BEFORE_THE_END}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["losses"] = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(summary["losses"]) == list(range(1, summary["steps"] + 1)), "the reference lacks a step's record"
    return summary

