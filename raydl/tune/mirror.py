"""A sweep on a cluster without a shared disk: its directory kept in a bucket as well.

When the sweep's base `checkpoint.storage_path` is a URI, `<storage_path>/<sweep name>/` holds

    sweep.yaml, trial_starts.jsonl, completed_trials.txt, results.*, best.yaml   (the driver's files)
    tune/                                   Tune's experiment (its storage_path)
    trials/<trial_id>/attempt-N/            each attempt's run directory (config, metrics, summary)
    checkpoints/<trial_id>/attempt-N-<id>/  each attempt's checkpoints

A trial writes its attempt on the disk of whichever node runs it and uploads it when the attempt ends (failed
too); before an attempt starts it pulls the trial's earlier attempts, wherever they ran, to resume from their
checkpoints. The driver pulls trials/ before it writes the report, and `raydl sweep --resume s3://...` rebuilds
the local sweep directory from the bucket when the driver's node is gone.
"""

from __future__ import annotations

from pathlib import Path

from raydl import storage
from raydl.config import JobConfig

TRIALS, CHECKPOINTS = "trials", "checkpoints"
FIELD = "checkpoint.storage_path"


def location(base: JobConfig, sweep_name: str) -> str | None:
    """The sweep's place in the bucket, or None when its base config checkpoints locally."""
    storage_path = base.checkpoint.storage_path
    return storage.join(storage_path, sweep_name) if storage.is_uri(storage_path) else None


def trial_checkpoints(mirror: str, trial_id: str) -> str:
    """The trial's checkpoint.storage_path: its attempts' checkpoints beside the sweep, one folder per trial."""
    return storage.join(mirror, CHECKPOINTS, trial_id)


def push_file(local: Path, mirror: str) -> None:
    """One of the driver's files (absent: nothing) to the sweep's place in the bucket."""
    if local.is_file():
        fs, path = storage.resolve(mirror, FIELD)
        storage.write_bytes(fs, f"{path}/{local.name}", local.read_bytes())


def push_attempt(run_dir: Path, mirror: str, trial_id: str) -> None:
    """An attempt's run directory (its checkpoints are in the bucket already) to trials/<trial>/attempt-N/."""
    fs, path = storage.resolve(storage.join(mirror, TRIALS, trial_id, run_dir.name), FIELD)
    storage.upload_dir(str(run_dir), fs, path)


def pull(mirror: str, local: Path, *parts: str, only: tuple[str, ...] = ()) -> None:
    """<mirror>/<parts> into local/<parts> (files already there are replaced by the bucket's)."""
    fs, path = storage.resolve(storage.join(mirror, *parts), FIELD)
    storage.download_dir(fs, path, str(local.joinpath(*parts)), only=only)
