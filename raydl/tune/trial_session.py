"""How a sweep trial tells Tune its progress, and the session of a trial that trains in its own process.

A 1-worker trial (space.trains_in_trial) runs the per-worker loop right in its Tune trial, as
`python -m raydl.worker` runs it without torchrun: checkpoints go straight into the attempt's run
directory and metrics.jsonl is written here. Starting a Ray Train controller and a worker actor
for such a trial only added to its start. Larger trials keep Ray Train (TrialReporter);
both report the same Tune metrics, computed by TrialMetrics.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ray.tune.integration.ray_train import TuneReportCallback

from raydl.config import JobConfig
from raydl.telemetry.records import WorkerReport
from raydl.train.session import TorchrunSession
from raydl.tune import report


class TrialMetrics:
    """Tune's flat scalars over the whole trial so far. `records` starts with the steps of earlier attempts of
    this trial, so a resumed trial still reports its true time to target and sample count."""

    def __init__(self, *, target: float | None, target_metric: str, records: list[dict[str, Any]]):
        self.target, self.target_metric, self.records = target, target_metric, list(records)

    def update(self, rank0: WorkerReport) -> dict[str, Any]:
        self.records = report.stitch([self.records, [r.to_dict() for r in rank0.records]])
        final = dataclasses.asdict(rank0.final) if rank0.final else None
        return report.trial_metrics(self.records, final, target=self.target, target_metric=self.target_metric)


class InTrialSession(TorchrunSession):
    """A lone worker in the Tune trial's process: writes its run directory like torchrun's rank 0 and also
    reports every batch of steps to Tune (one Tune result each, which ASHA reads)."""

    def __init__(self, run_dir: str, run_id: str, cfg: JobConfig, events_dir: str | None, trackers: dict,
                 metrics: TrialMetrics):
        super().__init__(run_dir, cfg.checkpoint.keep, cfg.telemetry.progress, events_dir, trackers,
                         storage_path=cfg.checkpoint.storage_path, run_id=run_id)
        self.metrics = metrics
        # A lone worker saves its checkpoint without a process group by design; torch warns at every save.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

    def report(self, worker_report: WorkerReport, checkpoint: str | None = None, *, whole: bool = True) -> None:
        from ray import tune

        super().report(worker_report, checkpoint, whole=whole)
        tune.report(self.metrics.update(worker_report))


class TrialReporter(TuneReportCallback):
    """Forwards each rank-0 report of a Ray Train trial to Tune (runs in the Train controller)."""

    def __init__(self, metrics: TrialMetrics):
        super().__init__()
        self.metrics = metrics

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        scalars = self.metrics.update(WorkerReport.from_dict(metrics[0]))
        super().after_report(run_context, [scalars], checkpoint)
