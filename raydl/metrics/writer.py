"""Worker reports -> metrics.jsonl, the progress line and summary.json.

The writer runs where the run directory is: in the metrics sink actor (raydl.metrics.sink, pinned to
the driver's node) under Ray, or in the rank-0 process under torchrun. It also keeps the run's
record: world sizes, layouts, restarts, the survivors path's changes of members (raydl.metrics.members) and
device-hours with their cost (raydl.telemetry.cost).

Throughput is what a stopwatch sees: samples over the elapsed wall time of the run's steady part
(the steps after the first fifth), evaluations, reports, checkpoints and restarts included; each
step's own rate is kept as `step_rate` (the median over the steady steps).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raydl import log as raydl_log
from raydl.console import Console, Progress
from raydl.metrics.members import MemberChanges
from raydl.metrics.run_mirror import RunMirror
from raydl.metrics.stopwatch import stopwatch
from raydl.metrics.tensorboard import EventsWriter
from raydl.metrics.trackers import open_trackers, report_png, send
from raydl.telemetry.cost import CostMeter, Pricing, last_line
from raydl.telemetry.records import FinalInfo, StepRecord, WorkerReport

log = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, run_dir: str | Path, *, progress: bool = True, events_dir: str | None = None,
                 trackers: dict | None = None, say: Callable[[str | Progress], None] | None = None,
                 mirror: str | None = None):
        """`events_dir`: also write TensorBoard events there (telemetry.tensorboard). `trackers`: also log to the
        experiment trackers these settings name (raydl.metrics.trackers.settings_for). `say`: where the progress
        goes (the sink keeps it for the driver to show; default: a Console of this process). `mirror`: a bucket
        location that keeps a copy of the run's record (raydl.metrics.run_mirror)."""
        raydl_log.ensure_configured()   # it runs in Train's controller actor or a torchrun rank: not the CLI's process
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.progress, self.say = progress, say or Console().show
        self.records: list[StepRecord] = []
        self.world_sizes: list[int] = []
        self.layouts: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.members = MemberChanges()
        self.last_checkpoint: str | None = None
        self.pending_cause: str | None = None   # why the current worker group will end, told before its successor
        self.events = EventsWriter(events_dir) if events_dir else None
        self.trackers = open_trackers(trackers, self.run_dir) if trackers else []
        for tracker in self.trackers:
            self.say(f"logging to {tracker.where}")
        self.mirror = RunMirror(self.run_dir, mirror) if mirror else None
        self.cost = CostMeter(Pricing.for_run_dir(self.run_dir))
        if line := last_line(self.path):   # a torchrun restart in place: the run's totals go on from there
            self.cost.resume(line)

    def fail_trackers(self) -> None:
        """The run ended without its final report (an error, a lost cluster): its tracker runs are marked failed."""
        self.trackers = send(self.trackers, "fail")

    @property
    def preempted(self) -> bool:
        """The group ended at a drain notice: whatever errors its end raises, the restart is a preemption's."""
        return (self.pending_cause or "").startswith("preemption")

    def note_failure(self, cause: str) -> None:
        """A worker group failed (told by Ray Train's controller): the cause of the restart that follows.
        A group that ended at a drain notice ended by preemption, whatever errors its end raised."""
        if not self.preempted:
            self.pending_cause = cause

    def note_member(self, told: dict[str, Any]) -> None:
        """From Ray Train's controller, on the survivors path: a worker lost or its replacement started
        (raydl.driver.member_watch)."""
        self.members.from_ray(told)

    def write(self, report: WorkerReport, *, world_size: int, checkpoint: str | None = None) -> None:
        records = report.records
        for change in (c for r in records for c in r.members or ()):
            self.members.from_worker(change)
        if report.preempted:   # the checkpoint at a drain notice: the group's end, whatever errors follow
            self.pending_cause = f"preemption notice (checkpoint at step {report.step})"
        if records and self.records and report.group_start:
            before = self.records[-1].world_size
            cause = (self.pending_cause or (f"resize {before} -> {world_size} workers" if before != world_size
                      else "restart (no worker error reported)"))
            self.pending_cause = None
            self.restarts.append(self._restart(cause, records[0]))
        if world_size not in self.world_sizes:
            self.world_sizes.append(world_size)
        self._note_layout(report.layout, records)
        self.cost.charge(records, device=report.device, group_start=report.group_start)
        with self.path.open("a") as f:
            for r in records:
                f.write(json.dumps(r.to_dict()) + "\n")
        self.records.extend(records)
        if self.events:
            self.events.write(records, restarts=self.restarts, layouts=self.layouts)
        if self.trackers:
            self.trackers = send(self.trackers, "write", records, restarts=self.restarts, layouts=self.layouts)
        if checkpoint:
            self.last_checkpoint = checkpoint
        if records and self.progress:
            self._print_progress(records[-1], report.total_steps)
        if report.final:
            self.write_summary(report.final)
        if self.mirror:
            self.mirror.push(now=report.final is not None)

    def _restart(self, cause: str, first: StepRecord) -> dict[str, Any]:
        """A new worker group's first step: how many steps it redoes and the wall time the restart cost.

        gap_s: from the last step before to the first step after (the new group's start); seconds_lost: that, plus the
        time to redo the steps that had been done but not checkpointed (at the median step time).
        """
        last = self.records[-1]
        redone = max(0, last.step - first.step + 1)
        step_s = statistics.median(r.elapsed_s for r in self.records[-20:])
        gap = first.time - first.elapsed_s - last.time
        return {"cause": cause, "step": last.step, "resumed_at_step": first.step - 1, "steps_redone": redone,
                "gap_s": round(gap, 3), "seconds_lost": round(gap + redone * step_s, 2)}

    def _note_layout(self, layout: dict[str, Any], records: list[StepRecord]) -> None:
        if not layout or not records:
            return
        current = {k: layout.get(k) for k in ("world_size", "dp", "pp", "num_microbatches", "micro_batch", "schedule",
                                              "dp_wrapper", "dp_wrapper_reason")}
        if not self.layouts or {k: self.layouts[-1][k] for k in current} != current:
            self.layouts.append({**current, "from_step": records[0].step, "to_step": records[-1].step})
        self.layouts[-1]["to_step"] = records[-1].step

    def _print_progress(self, r: StepRecord, total: int) -> None:
        recent = self.records[-20:]
        rate, elapsed = stopwatch(recent)
        eta = f" eta {max(0, total - r.step) * elapsed / len(recent):.0f}s" if total and elapsed else ""
        self.say(Progress(r.step, total, f"loss {r.loss:.4f} lr {r.lr:.2e} {rate:.0f} samples/s "
                                         f"data-wait {100 * r.data_wait_frac:.1f}% ws {r.world_size} "
                                         f"{self.cost.progress()}{eta}"))

    def summary(self, final: FinalInfo) -> dict[str, Any]:
        recs = self.records
        steady = recs[len(recs) // 5:] or recs
        samples_per_s, _ = stopwatch(steady)
        step_rate = statistics.median(r.samples_per_s for r in steady) if steady else 0.0
        wall_share = samples_per_s / step_rate if step_rate else 0.0   # the stopwatch's rate / the steps' own
        return {
            "steps": recs[-1].step if recs else 0,
            "samples": final.samples,
            "first_loss": recs[0].loss if recs else None,
            "final_loss": recs[-1].loss if recs else None,
            "eval": final.eval,
            "samples_per_s": samples_per_s,
            "tokens_per_s": wall_share * statistics.median(r.tokens_per_s for r in steady) if steady else 0.0,
            "step_rate": step_rate,
            "time_in": self.time_in(),
            "data_wait_frac": statistics.median(r.data_wait_frac for r in steady) if steady else 0.0,
            **_median_if_known(steady, "model_tflops_per_s", wall_share),
            **_median_if_known(steady, "mfu", wall_share),
            "peak_memory_mb": max((r.peak_memory_mb for r in recs), default=0.0),
            "world_sizes": self.world_sizes,
            "layouts": self.layouts,
            "restarts": self.restarts,
            "members": self.members.summary(),
            "precision": final.precision,
            "wall_s": final.wall_s,
            "stopped_by_signal": final.stopped_by_signal,
            "compile": final.compile,
            "checkpoint": self.last_checkpoint,
            **self.cost.summary(),
        }

    def time_in(self) -> dict[str, float]:
        """Where the run's wall time went, from its first step's start to its last step's end (seconds).
        `other`: the rest (waiting between steps for anything not named here)."""
        recs = self.records
        if not recs:
            return {}
        spent = {"steps": sum(r.step_s for r in recs),
                 "eval": sum(r.eval_s or 0.0 for r in recs[:-1]),   # the last step's eval ran after its end
                 "reports": sum(r.report_s for r in recs),
                 "checkpoint": sum(r.checkpoint_s for r in recs),
                 "restarts": sum(r["gap_s"] for r in self.restarts)}
        wall = recs[-1].time - (recs[0].time - recs[0].elapsed_s)
        spent["other"] = wall - sum(spent.values())
        return {"wall": wall, **{k: round(v, 3) for k, v in spent.items()}}

    def write_summary(self, final: FinalInfo) -> dict[str, Any]:
        summary = self.summary(final)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if self.trackers:
            self.trackers = send(self.trackers, "finish", self.run_dir, report_png(self.run_dir))
        return summary


def _median_if_known(records: list[StepRecord], key: str, scale: float) -> dict[str, float]:
    """{key: median x scale} when the steady steps measured it (model FLOPs and device peak known), else {}.
    `scale`: the stopwatch's rate over the steps' own, so that FLOP/s and MFU count the time between steps."""
    values = [getattr(r, key) for r in records if getattr(r, key) is not None]
    return {key: scale * statistics.median(values)} if records and len(values) == len(records) else {}
