"""The run directory's record beside its checkpoints in a bucket, when checkpoint.storage_path is a URI.

The run directory (config.yaml, metrics.jsonl, summary.json) is on the driver's disk (rank 0's under torchrun);
a node that dies takes it along. Its small files are copied to <storage_path>/<run>-<run id>/run/ every
PUSH_EVERY_S while the run trains and once at its end, so `raydl report` and `raydl train --resume` work from the
bucket alone. An upload that fails is a warning: the run goes on, the next push tries again.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from raydl import storage
from raydl.errors import one_line

PUSH_EVERY_S = 30.0
# run_id: raydl.driver.run_location.RUN_ID_FILE; dataset.json: raydl.driver.resume.DATASET_FILE
FILES = ("config.yaml", "run_id", "dataset.json", "metrics.jsonl", "summary.json")
FOLDER = "run"

log = logging.getLogger(__name__)


def location(checkpoints_at: str) -> str | None:
    """Where the run's record goes, beside checkpoints at `checkpoints_at`; None for local checkpoints."""
    return storage.join(checkpoints_at, FOLDER) if storage.is_uri(checkpoints_at) else None


class RunMirror:
    def __init__(self, run_dir: Path, at: str):
        self.run_dir, self.at = run_dir, at
        self.pushed_at = -math.inf

    def push(self, *, now: bool = False) -> None:
        if not now and time.monotonic() - self.pushed_at < PUSH_EVERY_S:
            return
        self.pushed_at = time.monotonic()
        try:
            fs, path = storage.resolve(self.at, "checkpoint.storage_path")
            for name in FILES:
                if (self.run_dir / name).is_file():
                    storage.write_bytes(fs, f"{path}/{name}", (self.run_dir / name).read_bytes())
        except OSError as e:
            log.warning(f"could not copy the run's record to {self.at} ({one_line(e)[:200]}); trying again later")
