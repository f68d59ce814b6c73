"""Start-up of one run: wall-clock marks (time.time()) from the command's start to its first finished step,
and the phases between them (summary.json's `startup`; `raydl bench startup` takes medians of them).

The driver marks its own (DRIVER_MARKS); every worker marks its own (WORKER_MARKS) and the worker group sends the
latest of each over its ranks (the slowest rank holds the first step back) with its first step record.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

DRIVER_MARKS = ("command_start", "prepared", "ray_connected", "fit_called")
WORKER_MARKS = ("controller_process_start", "worker_process_start", "worker_imports_done", "process_group_ready",
                "model_built", "data_open", "first_batch", "compiled", "first_step")
ORDER = DRIVER_MARKS + WORKER_MARKS   # the order they happen in; a phase is named by the mark that ends it
# `compiled` (train.compile only): the first step's forward and backward, which compile the blocks, are done.


def process_start_time(pid: int | str = "self") -> float | None:
    """When the process was created (its interpreter start and imports count), or None without /proc.

    From uptime, not /proc/stat's btime: btime has whole seconds only."""
    stat, uptime = Path(f"/proc/{pid}/stat"), Path("/proc/uptime")
    if not (stat.exists() and uptime.exists()):
        return None
    ticks = int(stat.read_text().rsplit(")", 1)[1].split()[19])   # field 22, starttime: clock ticks after boot
    return time.time() - float(uptime.read_text().split()[0]) + ticks / os.sysconf("SC_CLK_TCK")


def command_start() -> float:
    """The `raydl` command's process start; in any other process (the Python API, a sweep trial): now."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    from_cli = argv0.name == "raydl" or argv0.parts[-2:] == ("cli", "__init__.py")
    return (process_start_time() if from_cli else None) or time.time()


class Marks(dict):
    """mark name -> wall-clock time."""

    def mark(self, name: str, at: float | None = None) -> None:
        self[name] = time.time() if at is None else at


def breakdown(marks: dict[str, float]) -> dict[str, Any]:
    """at_s: mark -> seconds after command_start; phase_s: mark -> seconds after the mark before it (in ORDER,
    among those present); to_first_step_s: the command -> first step total."""
    start = marks["command_start"]
    present = [name for name in ORDER if name in marks]
    at = {name: round(marks[name] - start, 3) for name in present}
    phases = {name: round(at[name] - at[before], 3) for before, name in itertools.pairwise(present)}
    return {"at_s": at, "phase_s": phases, "to_first_step_s": at.get("first_step")}


def worker_group_marks(marks: dict[str, float], first, device, controller_start: float | None) -> dict[str, float]:
    """The worker group's marks up to its first step record `first`, each the latest over the ranks
    (a collective: every rank calls it), with the controller's start that rank 0 asked for."""
    import torch
    import torch.distributed as dist

    own = {**marks, "first_batch": first.time - first.step_s + first.data_wait_s, "first_step": first.time}
    names = [name for name in WORKER_MARKS if name in own]
    latest = torch.tensor([own[name] for name in names], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(latest, op=dist.ReduceOp.MAX)
    group = dict(zip(names, latest.tolist()))
    return {**group, "controller_process_start": controller_start} if controller_start else group
