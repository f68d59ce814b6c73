"""Checkpoints with torch.distributed.checkpoint (DCP): layout-agnostic and atomic.

A checkpoint directory holds DCP shards (`__<rank>_0.distcp`, `.metadata`) keyed by fully
qualified parameter names, so it loads into any layout (N or M workers, any dp × pp), and
`raydl_state.json` (step, data position, scaler, model fingerprint), written last. A
directory counts as a checkpoint only once both `.metadata` and `raydl_state.json` exist;
under Ray it is also only visible after Ray registered it (every rank reported and
uploaded). RNG needs no saved state: it is reseeded from (seed, step, rank) every step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from raydl.errors import CheckpointError

STATE_FILE = "raydl_state.json"
FORMAT = 1


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: str | Path) -> bool:
    p = Path(path)
    return (p / STATE_FILE).is_file() and (p / ".metadata").is_file()


def save(path: str | Path, model: nn.Module, optimizer, state: dict[str, Any], *, rank: int) -> None:
    """Every rank writes its shards into `path` (its own or a shared dir); rank 0 writes the state last."""
    Path(path).mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    if rank == 0:
        tmp = Path(path) / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps({"format": FORMAT, **state}, indent=1))
        os.replace(tmp, Path(path) / STATE_FILE)


def read_state(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"resume path '{p}' does not exist. Fix: pass a run directory or one of its "
                              f"checkpoints (runs/<run>/train/step_NNNNNNNN).")
    if not is_complete(p):
        raise CheckpointError(f"'{p}' is not a complete raydl checkpoint (needs .metadata and {STATE_FILE}); it may "
                              f"be half-written. Fix: resume from an earlier checkpoint of the run.")
    try:
        return json.loads((p / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint state '{p / STATE_FILE}' is unreadable ({e}). Fix: resume from an "
                              f"earlier checkpoint of the run.") from None


def check_compatible(state: dict[str, Any], fingerprint: dict[str, Any], path: str | Path) -> None:
    saved = state.get("model", {})
    if saved != fingerprint:
        raise CheckpointError(f"checkpoint '{path}' was saved from model {saved} but this run builds {fingerprint}. "
                              f"Fix: resume with the same model.name/model.size and dataset, or start a new run "
                              f"without --resume.")


def load(path: str | Path, model: nn.Module, optimizer, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Load model + optimizer shards for this rank's part of the model; returns the trainer state."""
    state = read_state(path)
    check_compatible(state, fingerprint, path)
    msd, osd = get_state_dict(model, optimizer)
    try:
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
    except Exception as e:  # DCP raises assorted errors on missing/corrupt shards
        raise CheckpointError(f"checkpoint '{path}' could not be loaded ({type(e).__name__}: {str(e)[:300]}). "
                              f"Fix: resume from an earlier checkpoint of the run.") from e
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    return state


def find_latest(root: str | Path) -> Path | None:
    """Newest complete checkpoint under a run directory (or `root` itself if it is one)."""
    root = Path(root)
    if is_complete(root):
        return root
    candidates = sorted(root.glob("train/step_*")) + sorted(root.glob("step_*"))
    complete = [c for c in candidates if is_complete(c)]
    return max(complete, key=lambda c: c.name) if complete else None


def resolve_resume(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--resume path '{p}' does not exist. Fix: pass a run directory or a checkpoint "
                              f"directory inside it (train/step_NNNNNNNN).")
    latest = find_latest(p)
    if latest is None:
        raise CheckpointError(f"--resume path '{p}' holds no complete checkpoint. Fix: pass a run directory that "
                              f"saved at least one checkpoint, or start without --resume.")
    return latest.resolve()
