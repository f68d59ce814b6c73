"""TensorBoard events of a run (telemetry.tensorboard): the scalars of metrics.jsonl, restarts and layouts as text.

The metrics writer feeds these events from the records it appends to metrics.jsonl, so the two
never disagree, and it runs where the run directory is (the Ray Train controller, or rank 0 under
torchrun): one events writer per run. A run writes to <run_dir>/tensorboard, so
`tensorboard --logdir runs/` lists every run; a sweep gives each trial <sweep_dir>/tensorboard/<trial>,
which all its attempts append to, so TensorBoard compares trials rather than attempts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from raydl.config import JobConfig
from raydl.errors import ConfigError
from raydl.telemetry.records import StepRecord

EVENTS_DIR = "tensorboard"
JOB_KEY = "tensorboard_dir"   # set in the job by a caller (a sweep trial) that chooses the directory itself
NOT_SCALARS = ("step", "time")   # the x axes: step, and the wall time every event carries
# TensorBoard's sections are the part of a tag before '/'; a key not listed here goes to "other".
SECTIONS = {
    "loss": "loss", "eval_loss": "loss",
    "lr": "optimizer", "grad_norm": "optimizer",
    "samples_per_s": "throughput", "tokens_per_s": "throughput", "model_tflops_per_s": "throughput", "mfu": "throughput",
    "step_s": "time", "between_s": "time", "data_wait_s": "time", "data_wait_frac": "time", "eval_s": "time",
    "report_s": "time", "checkpoint_s": "time",
    "peak_memory_mb": "memory", "gpu_mem_used_mb": "memory",
    "gpu_util_pct": "gpu", "gpu_power_w": "gpu", "gpu_temp_c": "gpu",
    "device_hours": "cost", "cost_usd": "cost",
    "world_size": "run", "epoch": "run", "samples": "run", "bad_shards": "run",
}


def require_installed(cfg: JobConfig) -> None:
    """Fail before Ray starts when telemetry.tensorboard asks for events that no installed writer could write."""
    if cfg.telemetry.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("telemetry.tensorboard", "is true but the tensorboard package is not installed",
                          'pip install "raydl[tensorboard]", or set telemetry.tensorboard=false')


def events_dir(cfg: JobConfig, job: dict[str, Any]) -> str | None:
    """Where this run's events go; None when telemetry.tensorboard is off."""
    if not cfg.telemetry.tensorboard:
        return None
    return job.get(JOB_KEY) or str(Path(job["run_dir"]) / EVENTS_DIR)


def tag(key: str) -> str:
    return f"{SECTIONS.get(key, 'other')}/{key}"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every number of a metrics.jsonl line, by its TensorBoard tag."""
    return {tag(k): v for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float)) and not isinstance(v, bool)}


def restart_text(restart: dict[str, Any]) -> str:
    return (f"{restart['cause']} after step {restart['step']}: resumed at step {restart['resumed_at_step']}, "
            f"{restart['steps_redone']} steps redone, {restart['seconds_lost']} s lost")


def layout_text(layout: dict[str, Any]) -> str:
    return (f"{layout['world_size']} workers from step {layout['from_step']}: dp {layout['dp']} x pp {layout['pp']}, "
            f"{layout['num_microbatches']} micro-batches of {layout['micro_batch']}, schedule {layout['schedule']}")


class EventsWriter:
    """Appends a run's records, restarts and layouts to TensorBoard event files in `log_dir`.

    A restart redoes the steps after its checkpoint: their new scalars come at lower steps than the
    last ones written, and TensorBoard's reader drops the old values from there on (purge_orphaned_data),
    as metrics.jsonl's readers do."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))
        self.restarts_written = self.layouts_written = 0

    def write(self, records: list[StepRecord], *, restarts: list[dict[str, Any]], layouts: list[dict[str, Any]]) -> None:
        for restart in restarts[self.restarts_written:]:
            self.writer.add_text("events/restarts", restart_text(restart), restart["resumed_at_step"] + 1)
        for layout in layouts[self.layouts_written:]:
            self.writer.add_text("events/layouts", layout_text(layout), layout["from_step"])
        self.restarts_written, self.layouts_written = len(restarts), len(layouts)
        for record in records:
            for name, value in scalars(record.to_dict()).items():
                self.writer.add_scalar(name, value, record.step, walltime=record.time)
        self.writer.flush()   # a run can end at any report (a node lost, Ctrl-C): what was reported is on disk
