"""The typed contract between the worker's step and the driver's metrics, callbacks and summary.

A worker builds a `StepRecord` per optimizer step and sends a `WorkerReport` at every report.
On the wire (a Ray Train report, or the torchrun rank-0 call) they are plain dicts, because
Ray's reports must be JSON-like; `to_dict`/`from_dict` are the only places that know the keys.
A `StepRecord` dict is also one line of metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GPU_KEYS = ("gpu_util_pct", "gpu_mem_used_mb", "gpu_power_w", "gpu_temp_c")


@dataclass(kw_only=True)
class StepRecord:
    """One optimizer step as the worker measured it."""

    step: int
    epoch: int
    loss: float                  # mean over the ranks that compute a loss (all of DP, the last stage of PP)
    lr: float
    grad_norm: float
    samples: int                 # the global batch of this step
    world_size: int
    time: float                  # wall clock at the end of the step
    step_s: float                # the step itself: waiting for its batch, forward, backward, optimizer
    # Wall time between the previous step's end and this step's start (an eval, a report, a checkpoint):
    # time - step_s - between_s is the previous step's `time`. report_s and checkpoint_s are the parts of it spent
    # reporting and saving after the previous step (an eval's part is that step's eval_s).
    between_s: float = 0.0
    report_s: float = 0.0
    checkpoint_s: float = 0.0
    data_wait_s: float
    data_wait_frac: float
    samples_per_s: float
    tokens_per_s: float          # samples x the model's units per sample (tokens, or 1 per image)
    bad_shards: int
    peak_memory_mb: float
    model_tflops_per_s: float | None = None   # all workers together; None when the model's FLOPs are unknown
    mfu: float | None = None                  # None when the device's peak is unknown (CPU, unlisted GPU)
    gpu: dict[str, float] = field(default_factory=dict)   # NVML readings, on GPU only
    eval_loss: float | None = None
    eval_s: float | None = None               # the eval after this step (in the next step's between_s)
    # The run's running totals up to this step, added by the driver's writer (raydl.telemetry.cost).
    device_hours: float | None = None         # GPU-hours, or CPU core-hours on a CPU run
    cost_usd: float | None = None             # None: no price known for the device
    # A worker group's first step only: its start-up marks (raydl.telemetry.startup), mark -> wall clock.
    startup: dict[str, float] | None = None
    # The survivors path only: the workers lost or joined before this step (raydl.train.survivors.ChangeRecord).
    members: list[dict[str, Any]] | None = None

    @property
    def elapsed_s(self) -> float:
        """Wall time since the previous step's end: this step and what ran before it."""
        return self.between_s + self.step_s

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "gpu"}
        return {**out, **self.gpu}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepRecord":
        known = {f.name for f in dataclasses.fields(cls)}
        gpu = {k: data[k] for k in GPU_KEYS if k in data}
        return cls(**{k: v for k, v in data.items() if k in known}, gpu=gpu)


@dataclass(kw_only=True)
class FinalInfo:
    """What the workers know at the end of a run (the driver adds the rest of the summary)."""

    samples: int
    steps: int
    eval: dict[str, float]
    precision: str
    wall_s: float
    stopped_by_signal: int = 0   # SIGINT/SIGTERM that stopped the run early with a checkpoint; 0 = ran to the end
    compile: dict[str, float] | None = None   # train.compile's seconds and recompiles on rank 0; None when eager


@dataclass(kw_only=True)
class WorkerReport:
    """Rank 0's report: the steps since the last report, the layout, and the run's end when it came."""

    records: list[StepRecord]
    layout: dict[str, Any]
    total_steps: int
    step: int
    group_start: bool = False          # the first report of a new worker group (start, restart or resize)
    preempted: bool = False            # carries the checkpoint taken at a preemption notice
    final: FinalInfo | None = None
    device: str = "cpu"                # what the workers train on: cpu or the GPU's name (prices the device-hours)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["records"] = [r.to_dict() for r in self.records]
        return out

    def registered_metrics(self) -> dict[str, Any]:
        """What Ray Train keeps with a checkpoint (its Result.metrics; the records themselves go to the sink)."""
        return {"step": self.step, "preempted": self.preempted}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkerReport":
        final = data.get("final")
        return cls(**{**data, "records": [StepRecord.from_dict(r) for r in data.get("records", [])],
                      "final": FinalInfo(**final) if final else None})
