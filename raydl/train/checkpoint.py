"""Checkpoints with torch.distributed.checkpoint (DCP): layout-agnostic and atomic.

A checkpoint directory holds DCP shards (`__<rank>_0.distcp`, `.metadata`) keyed by fully
qualified parameter names, so it loads into any layout (N or M workers, any dp × pp), and
`raydl_state.json` (step, data position, scaler, model fingerprint), written last, and one
`files-rank<r>.json` per saving rank listing its files with size and sha256. A directory
counts as a checkpoint only once `verify` finds every rank's manifest and every file intact;
under Ray it is also only visible after Ray registered it (every rank reported and
uploaded). A half-written or corrupted checkpoint is skipped for the previous one.
RNG needs no saved state: it is reseeded from (seed, step, rank) every step.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from raydl.checksum import sha256_file
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
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    mine = sorted(path.glob(f"__{rank}_*.distcp")) + ([path / ".metadata"] if rank == 0 else [])
    _write_atomic(path / f"files-rank{rank}.json", json.dumps({f.name: _fingerprint(f) for f in mine}))
    if rank == 0:
        _write_atomic(path / STATE_FILE, json.dumps({"format": FORMAT, **state}, indent=1))


def _write_atomic(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def _fingerprint(f: Path) -> list:
    return [f.stat().st_size, sha256_file(f)]


def verify(path: str | Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong (the same answer on every rank)."""
    p = Path(path)
    if not is_complete(p):
        return f"missing {STATE_FILE} or .metadata (half-written)"
    try:
        ranks = json.loads((p / STATE_FILE).read_text())["saved_by_ranks"]
        for r in range(ranks):
            manifest = p / f"files-rank{r}.json"
            if not manifest.is_file():
                return f"missing {manifest.name}"
            for name, expected in json.loads(manifest.read_text()).items():
                if not (p / name).is_file() or _fingerprint(p / name) != expected:
                    return f"{name} is missing or does not match its checksum"
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable state ({type(e).__name__}: {e})"
    return None


def first_valid(candidates: list[str]) -> str | None:
    """The newest candidate that verifies; warns naming each one skipped."""
    for i, path in enumerate(candidates):
        problem = verify(path)
        if problem is None:
            return path
        nxt = candidates[i + 1] if i + 1 < len(candidates) else "none (starting from scratch)"
        warnings.warn(f"checkpoint {path} is not usable ({problem}); falling back to {nxt}", stacklevel=2)
    return None


def agree_on_first_valid(candidates: list[str]) -> str | None:
    """`first_valid` decided once, on rank 0, and broadcast: verifying reads and hashes every rank's
    shards, which every rank of a large group would otherwise repeat. Candidates are listed in the
    same order on every rank (under Ray each node may hold its own download of each)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return first_valid(candidates)
    choice = [None]
    if dist.get_rank() == 0:
        chosen = first_valid(candidates)
        choice = [candidates.index(chosen) if chosen else -1]
    dist.broadcast_object_list(choice, src=0)
    return candidates[choice[0]] if choice[0] >= 0 else None


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


def all_complete(root: str | Path) -> list[Path]:
    """Complete checkpoints under a run directory (or `root` itself if it is one), newest first."""
    root = Path(root)
    if is_complete(root):
        return [root]
    candidates = list(root.glob("train/step_*")) + list(root.glob("step_*"))
    return sorted((c for c in candidates if is_complete(c)), key=lambda c: c.name, reverse=True)


def find_latest(root: str | Path) -> Path | None:
    complete = all_complete(root)
    return complete[0] if complete else None


def resolve_resume(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--resume path '{p}' does not exist. Fix: pass a run directory or a checkpoint "
                              f"directory inside it (train/step_NNNNNNNN).")
    latest = first_valid([str(c) for c in all_complete(p)])
    if latest is None:
        raise CheckpointError(f"--resume path '{p}' holds no complete checkpoint. Fix: pass a run directory that "
                              f"saved at least one checkpoint, or start without --resume.")
    return Path(latest).resolve()
