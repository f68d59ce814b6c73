"""Where a run keeps what identifies it and its checkpoints, read from its run directory: shared by the driver's
preparation, its messages, resume, init_from, sweeps' trials and export."""

from __future__ import annotations

import posixpath
from pathlib import Path

from raydl import storage
from raydl.config import JobConfig
from raydl.metrics import run_mirror

RUN_ID_FILE = "run_id"


def checkpoint_storage(cfg: JobConfig, run_dir: Path, run_id: str) -> tuple[str, str]:
    """(storage_path, name) of Ray Train's RunConfig: a run's checkpoints go to storage_path/name/step_N."""
    return storage.run_checkpoints(cfg.checkpoint.storage_path, run_dir, run_id)


def checkpoints_location(path: str) -> str:
    """Where the run directory `path` keeps its checkpoints (storage_path/<run>-<run id> for a Ray Train run with
    checkpoint.storage_path, which may be a URI), or `path` itself (a checkpoint, a URI, a run without one, or
    one whose checkpoints are in it: torchrun and 1-worker sweep trials write them there)."""
    if storage.is_uri(path):   # a run's record in a bucket (raydl.metrics.run_mirror) is beside its checkpoints
        return posixpath.dirname(path.rstrip("/")) if posixpath.basename(path.rstrip("/")) == run_mirror.FOLDER else path
    run_dir = Path(path)
    if not (run_dir / "config.yaml").is_file() or any(run_dir.glob("train/step_*")):
        return path
    from raydl.overrides import load_config

    cfg = load_config(str(run_dir / "config.yaml"), [])
    if not cfg.checkpoint.storage_path:
        return path
    return storage.join(*checkpoint_storage(cfg, run_dir, read_run_id(run_dir)))


def read_run_id(run_dir: Path) -> str:
    path = run_dir / RUN_ID_FILE
    return path.read_text().strip() if path.is_file() else run_dir.name
