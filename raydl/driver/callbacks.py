"""Ray Train controller-side callback: worker reports -> metrics.jsonl, progress line, summary.json.

Runs in the Train controller actor, which Ray pins to the driver's node, so it writes
into the run directory the driver created.
"""

from __future__ import annotations

from typing import Any

from ray.train import Checkpoint
from ray.train.v2.api.callback import UserCallback

from raydl.driver.metrics_writer import MetricsWriter
from raydl.telemetry.records import WorkerReport


class MetricsCallback(UserCallback):
    def __init__(self, run_dir: str, progress: bool, events_dir: str | None = None):
        self.run_dir, self.progress, self.events_dir = run_dir, progress, events_dir
        self.writer: MetricsWriter | None = None
        self.pending_cause: str | None = None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint: Checkpoint | None) -> None:
        if self.writer is None:
            self.writer = MetricsWriter(self.run_dir, progress=self.progress, events_dir=self.events_dir)
        report = WorkerReport.from_dict(metrics[0])
        if report.preempted:   # the checkpoint at a drain notice: the group's end, whatever errors follow
            self.pending_cause = f"preemption notice (checkpoint at step {report.step})"
        elif self.pending_cause:
            report.restart_cause, self.pending_cause = self.pending_cause, None
        self.writer.write(report, world_size=len(metrics), checkpoint=checkpoint.path if checkpoint else None)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        if self.pending_cause and self.pending_cause.startswith("preemption"):
            return   # the preempted node going away, not a failure of its own
        rank, error = next(iter(worker_exceptions.items()))
        self.pending_cause = f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
