"""debug.memory_dir: each rank's peak memory at three moments of a start, for `raydl bench memory`.

    start   the worker process before it builds its model (interpreter, torch, Ray)
    built   after its model is built, laid out, materialized and loaded (checkpoint or weights)
    end     the whole run

Peaks, not current values: resident set size's high-water mark on CPU (ru_maxrss), max_memory_allocated on a GPU.
"""

from __future__ import annotations

import json
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
        self.marks.update(about)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        path = Path(self.directory) / f"memory-rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": rank, **self.marks}))
