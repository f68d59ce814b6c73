"""Worker side: per-step timing records between two reports, model FLOP/s and peak memory.

Workers time each step, and the time between steps by what it was spent on (eval, report, checkpoint),
so that a stopwatch's throughput (samples over elapsed time) and the step rate (samples over a step's own
time) can both be told from the records. A step's loss and gradient norm stay on the device until the report
reads every pending step's in one transfer: no step waits for the GPU to finish the one before it.
Rank 0 sends them every `telemetry.report_every` steps;
`raydl.metrics.writer.MetricsWriter` turns them into files.
"""

from __future__ import annotations

import resource
import time

import torch

from raydl.telemetry.records import StepRecord


# Dense bf16 tensor-core peak per GPU (NVIDIA datasheets; the values torchtitan and nanoGPT use).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10G": 125e12}


def peak_flops(device: torch.device) -> float:
    """The device's bf16 peak, or 0 when unknown (CPU, unlisted GPU): then no MFU is reported."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)


class StepClock:
    """Times this worker's steps and collects their records between two reports."""

    def __init__(self, *, first_step: int = 1, peak_flops_total: float = 0.0, units_per_sample: int = 1,
                 flops_per_sample: float = 0.0):
        self.pending: list[StepRecord] = []
        self.peak_flops_total = peak_flops_total   # over all workers: MFU = model FLOP/s / this
        self.units_per_sample, self.flops_per_sample = units_per_sample, flops_per_sample
        self.first_step = first_step          # the first step this worker group will run
        self.t_last = self.t_begin = time.perf_counter()   # the previous step's end; this step's start
        self.spent: dict[str, float] = {}     # since the previous step's end: seconds by what they went to

    def begin(self) -> None:
        """A step starts (before it waits for its batch)."""
        self.t_begin = time.perf_counter()

    def spend(self, kind: str, seconds: float) -> None:
        """Time between two steps that went to `kind` (report, checkpoint): on the next step's record."""
        self.spent[kind] = self.spent.get(kind, 0.0) + seconds

    def record(self, *, step: int, epoch: int, loss: torch.Tensor | float, lr: float,
               grad_norm: torch.Tensor | float, samples: int,
               world_size: int, data_wait_s: float, bad_shards: int, device: torch.device,
               gpu: dict[str, float]) -> StepRecord:
        now = time.perf_counter()
        step_s, between_s, self.t_last = now - self.t_begin, self.t_begin - self.t_last, now
        spent, self.spent = self.spent, {}
        flops_per_s = samples * self.flops_per_sample / step_s
        record = StepRecord(
            step=step, epoch=epoch, loss=loss, lr=lr, grad_norm=grad_norm, samples=samples, world_size=world_size,
            time=time.time(), step_s=step_s, between_s=between_s, report_s=spent.get("report", 0.0),
            checkpoint_s=spent.get("checkpoint", 0.0), data_wait_s=data_wait_s, data_wait_frac=data_wait_s / step_s,
            samples_per_s=samples / step_s, tokens_per_s=samples * self.units_per_sample / step_s,
            bad_shards=bad_shards, peak_memory_mb=peak_memory_mb(device), gpu=gpu,
            model_tflops_per_s=flops_per_s / 1e12 if flops_per_s else None,
            mfu=flops_per_s / self.peak_flops_total if flops_per_s and self.peak_flops_total else None)
        self.pending.append(record)
        return record

    def drain(self) -> list[StepRecord]:
        """The pending records, their losses and gradient norms read from the device (one CPU-GPU sync)."""
        out, self.pending = self.pending, []
        values = iter(host_values(*(v for r in out for v in (r.loss, r.grad_norm))))
        for r in out:
            r.loss, r.grad_norm = next(values), next(values)
        return out


def host_values(*values: torch.Tensor | float) -> list[float]:
    """Device scalars as floats, in one transfer (one CPU-GPU sync)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    read = iter(torch.stack([t.detach().float().to(tensors[0].device) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
