"""Worker side: per-step timing records between two reports, model FLOP/s and peak memory.

Workers time each step and report every `telemetry.report_every` steps (Ray caps reports at
about one per controller poll); the driver's `MetricsWriter` turns the reports into files.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch


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
    """Collects this worker's per-step records between two reports."""

    def __init__(self, first_step: int = 1, peak_flops_total: float = 0.0):
        self.pending: list[dict[str, Any]] = []
        self.peak_flops_total = peak_flops_total   # over all workers: MFU = model FLOP/s / this
        self.first_step = first_step          # the first step this worker group will run
        self.t_last = time.perf_counter()

    def record(self, **fields: Any) -> None:
        now = time.perf_counter()
        step_s = now - self.t_last
        self.t_last = now
        fields["step_s"] = step_s
        fields["data_wait_frac"] = fields["data_wait_s"] / step_s if step_s else 0.0
        fields["samples_per_s"] = fields["samples"] / step_s
        fields["tokens_per_s"] = fields["samples"] * fields.pop("units_per_sample") / step_s
        flops_per_s = fields["samples"] * fields.pop("flops_per_sample") / step_s
        if flops_per_s:
            fields["model_tflops_per_s"] = flops_per_s / 1e12   # all workers together
            if self.peak_flops_total:
                fields["mfu"] = flops_per_s / self.peak_flops_total
        self.pending.append(fields)

    def annotate(self, **fields: Any) -> None:
        """Add fields to the latest step's record (e.g. an eval run after it)."""
        self.pending[-1].update(fields)

    def drain(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out
