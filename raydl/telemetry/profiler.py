"""Worker side of profiling: torch.profiler over a few steps, then where each rank's step time went.

    raydl profile --steps 3 [--config F] [--set ...]                 # a short raydl train on Ray
    torchrun --nproc-per-node 2 -m raydl.worker --set telemetry.profile_steps=3
    raydl train --set telemetry.profile_steps=3                      # a long run: once per worker-group start

`telemetry.profile_steps` steps are recorded after the warm-up of each worker-group start (WARMUP_STEPS).
Then every rank writes <run_dir>/profile/rank<r>.json, a Chrome trace (Perfetto, chrome://tracing; with
CUDA activity on GPU), and reads its own breakdown from it (raydl.telemetry.profile_breakdown); the ranks
gather them and rank 0 writes <run_dir>/profile/breakdown.json and prints the table. A later worker group
(restart, resize) profiles its own layout over the same files.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from raydl.telemetry.profile_breakdown import RANGE_PREFIX, STEP_RANGE, format_table, rank_breakdown

log = logging.getLogger(__name__)

WARMUP_STEPS = 3   # a group's first steps are slow: lazy init, pipeline shape inference, allocator growth
PROFILE_DIR = "profile"
BREAKDOWN_FILE = "breakdown.json"


def phase(name: str) -> record_function:
    """A range of raydl's step in the trace, named raydl.<name> (a few µs when nothing profiles)."""
    return record_function(RANGE_PREFIX + name)


class StepProfiler:
    """Profiles the steps `first_step + WARMUP_STEPS ...` of one worker group; does nothing when num_steps is 0.

    The loop calls `begin(step)` before fetching a step's batch and `end(step)` after its record."""

    def __init__(self, num_steps: int, *, first_step: int, last_step: int, run_dir: str, session, layout):
        start = first_step + WARMUP_STEPS
        self.steps = range(start, min(start + num_steps, last_step + 1)) if num_steps else range(0)
        self.out_dir, self.session, self.layout = Path(run_dir) / PROFILE_DIR, session, layout
        self.step_s: list[float] = []
        self.profiler: profile | None = None
        self.step_range: record_function | None = None
        self.t_begin = 0.0
        if num_steps and not self.steps and session.rank == 0:
            log.warning(f"telemetry.profile_steps: this worker group runs steps {first_step}-{last_step}, too few "
                        f"for {WARMUP_STEPS} warm-up steps and one to profile; nothing profiled")

    def begin(self, step: int) -> None:
        if step not in self.steps:
            return
        if step == self.steps.start:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.profiler = profile(activities=activities)
            self.profiler.start()
        self.step_range = record_function(STEP_RANGE).__enter__()
        self.t_begin = time.perf_counter()

    def end(self, step: int) -> None:
        if step not in self.steps:
            return
        self.step_s.append(time.perf_counter() - self.t_begin)
        self.step_range.__exit__(None, None, None)
        if step == self.steps[-1]:
            self._finish()

    def _finish(self) -> None:
        """Write this rank's trace, gather every rank's breakdown, and (rank 0) write and print it."""
        self.profiler.stop()
        rank = self.session.rank
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank{rank}.json"
        self.profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        dp_rank, pp_rank = self.layout.coords(rank)
        mine = {"rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank, "trace": trace.name,
                **rank_breakdown(events, self.step_s, pipelined=self.layout.pp > 1)}
        ranks = gather(mine)
        if rank != 0:
            return
        device = self.session.device
        breakdown = {"steps": [self.steps.start, self.steps[-1]], "warmup_steps": WARMUP_STEPS,
                     "dir": str(self.out_dir), "unit": "seconds per step, mean over the profiled steps",
                     "layout": self.layout.to_dict(),
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "ranks": ranks}
        (self.out_dir / BREAKDOWN_FILE).write_text(json.dumps(breakdown, indent=1))


def print_table(run_dir: Path) -> None:
    """The run's profile as a table on stdout, where the launcher prints its result (`raydl profile`, rank 0 of
    `python -m raydl.worker`); nothing when the run profiled no steps. Printed by the worker, under Ray it
    reached the driver through Ray's log forwarding, sometimes after the command had returned."""
    path = Path(run_dir) / PROFILE_DIR / BREAKDOWN_FILE
    if path.exists():
        print(f"{format_table(json.loads(path.read_text()))}\nbreakdown: {path}", flush=True)


def gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's dict, in rank order (a collective: every rank calls it at the same step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
