"""debug.memory_dir: each rank's peak memory at four moments of a start, for `raydl bench memory`.

    start   the worker process before it builds its model (interpreter, torch, Ray)
    meta    after its model is built on meta: the model library's code imported (transformers' modeling module:
            ~70 MiB of RSS for a Llama, whatever its size), its modules created, no tensor storage yet
    built   after its model is laid out, materialized and loaded (checkpoint or weights)
    end     the whole run

Peaks (`<mark>_peak_mib`): resident set size's high-water mark on CPU (ru_maxrss), max_memory_allocated on a GPU.
Also the current value (`<mark>_now_mib`: VmRSS, memory_allocated), from which a later peak's growth is counted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from raydl.telemetry.step_clock import peak_memory_mb


class MemoryMarks:
    """Collects the marks of one rank; writes <dir>/memory-rank<r>.json at each mark (off without a dir)."""

    def __init__(self, directory: str = "", device: torch.device = torch.device("cpu")):
        self.directory, self.device, self.marks = directory, device, {}

    def mark(self, name: str, **about) -> None:
        if not self.directory:
            return
        self.marks[f"{name}_peak_mib"] = peak_memory_mb(self.device)
        self.marks[f"{name}_now_mib"] = _memory_now_mb(self.device)
        self.marks.update(about)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        path = Path(self.directory) / f"memory-rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": rank, **self.marks}))


def _memory_now_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return (proc_status_kib("VmRSS") or 0) / 1024


def proc_status_kib(field: str) -> int | None:
    """A `/proc/self/status` figure in KiB (VmRSS, VmData, ...); None without /proc or the field."""
    status = Path("/proc/self/status")
    found = re.search(rf"{field}:\s+(\d+) kB", status.read_text()) if status.exists() else None
    return int(found.group(1)) if found else None
