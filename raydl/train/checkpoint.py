"""Checkpoints with torch.distributed.checkpoint (DCP): layout-agnostic and atomic.

A checkpoint directory holds DCP shards (`__<rank>_0.distcp`, `.metadata`) keyed by fully
qualified parameter names, so it loads into any layout (N or M workers, any dp × pp), and
`raydl_state.json` (step, data position, scaler, model fingerprint), written last, and one
`files-rank<r>.json` per saving rank listing its files with size and sha256. A directory
counts as a checkpoint only once `verify` finds every rank's manifest and every file intact,
the state within its schema and `.metadata` readable without running code (`safe_dcp`);
under Ray it is also only visible after Ray registered it (every rank reported and
uploaded). A half-written, corrupted or edited checkpoint is skipped for the previous one.
RNG needs no saved state: it is reseeded from (seed, step, rank) every step.

On an object store (checkpoint.storage_path=s3://...; --resume with a URI) there is no atomic
rename and Ray uploads each rank's files in no set order, so a checkpoint whose upload was cut off
can hold raydl_state.json without all its shards: what makes it complete there is the same
`verify` (every rank's files-rank<r>.json, every file's checksum), run on a local download of it,
and loading reads such a download too (DCP and the checksums read local files).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import pyarrow.fs as pafs

from raydl import storage
from raydl.checksum import sha256_file
from raydl.errors import CheckpointError, is_out_of_memory
from raydl.models.lora import base_name, is_adapter
from raydl.train import safe_dcp
from raydl.train.checkpoint_keys import adapted, stored, tied_pairs, trained_part, unstored
from raydl.train.checkpoint_state import FORMAT, state_problem
from raydl.train.optim import states_one_by_one

log = logging.getLogger(__name__)

STATE_FILE = "raydl_state.json"
FIX_EARLIER = "Fix: resume from an earlier checkpoint of the run"
# The optimizer state keyed by parameter name (torchtitan's choice). In torch's default nested form every rank saves
# its param group's list of parameter names under one key, "optim.param_groups.0.params"; DCP keeps one rank's, and a
# pipeline stage then loaded another stage's names: its first optimizer step after a resume failed (KeyError:
# 'betas'). Checkpoints written before keep loading in their nested form.
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
NESTED_KEY = "optim.param_groups.0.params"
# The flat form also copies every group's hyperparameters (lr, betas, eps, weight_decay, ...) to each parameter:
# 583 of the tiny GPT's 795 checkpoint items, each pickled on its own, which took half of a save's time. They are the
# config's (and the lr a function of the step: raydl.train.optim), so a checkpoint holds the states alone and a
# resumed optimizer keeps the hyperparameters its config gave it; those of earlier checkpoints are not read.
HYPERPARAMETERS = "param_groups."


def optimizer_states(osd: dict[str, Any]) -> dict[str, Any]:
    """A flat optimizer state dict without its per-parameter copies of the hyperparameters."""
    return {key: value for key, value in osd.items() if not key.startswith(HYPERPARAMETERS)}


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def dir_name(path: str | Path) -> str:
    """A checkpoint directory's own name (step_N), of a local path or a URI."""
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def step_of(path: str | Path) -> int:
    """The step a checkpoint directory was saved at, from its name (step_N, or step_N.2 for a redone step N)."""
    return int(dir_name(path)[len("step_"):].split(".")[0])


def newer_than_registered(listed: list, registered: set[str], newest_registered: int | None) -> list:
    """Of the complete checkpoints `listed` at a run's location (newest first), those Ray's registry does not hold
    and that are newer than its newest: the survivors path's, written by the leading replica alone while the
    group was smaller (raydl.train.session.RaySession.save_alone)."""
    floor = -1 if newest_registered is None else newest_registered
    return [c for c in listed if dir_name(c) not in registered and step_of(c) > floor]


def is_complete(path: str | Path) -> bool:
    """Both files written last are there (a local path or a URI); `verify` checks the rest."""
    fs, p = storage.resolve(str(path), "--resume")
    files = fs.get_file_info([f"{p}/{STATE_FILE}", f"{p}/{safe_dcp.METADATA_FILE}"])
    return all(f.type == pafs.FileType.File for f in files)


def save(path: str | Path, model: nn.Module, optimizer, state: dict[str, Any], *, rank: int) -> None:
    """Every rank writes its shards into `path` (its own or a shared dir); rank 0 writes the state last."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with states_one_by_one(optimizer):
        msd, osd = get_state_dict(model, optimizer, options=FLAT_OPTIMIZER)
    msd = trained_part(msd, model)
    tied = tied_pairs(model)
    dcp.save({"model": stored(msd, tied), "optim": stored(optimizer_states(osd), tied)}, checkpoint_id=str(path))
    mine = sorted(path.glob(f"__{rank}_*.distcp")) + ([path / safe_dcp.METADATA_FILE] if rank == 0 else [])
    _write_atomic(path / f"files-rank{rank}.json", json.dumps({f.name: _fingerprint(f) for f in mine}))
    if rank == 0:
        _write_atomic(path / STATE_FILE, json.dumps({"format": FORMAT, **state}, indent=1))


def upload_shards(local: str | Path, location: str, *, rank: int) -> None:
    """This rank's files of the checkpoint saved at `local` (its shards and their manifest) to `location`, a URI.
    Rank 0's `.metadata` and state file go up in `upload_last`, once every rank's shards are there: a checkpoint in
    a bucket, where nothing is renamed atomically, is complete (`is_complete`) only when whole."""
    local = Path(local)
    manifest = f"files-rank{rank}.json"
    names = [n for n in json.loads((local / manifest).read_text()) if n != safe_dcp.METADATA_FILE]
    _upload(local, location, [*names, manifest])


def upload_last(local: str | Path, location: str) -> None:
    """Rank 0, after every rank's `upload_shards`: the two files that make the checkpoint complete, state last."""
    _upload(Path(local), location, [safe_dcp.METADATA_FILE, STATE_FILE])


def _upload(local: Path, location: str, names: list[str]) -> None:
    fs, path = storage.resolve(location, "checkpoint.storage_path")
    if isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(path, recursive=True)   # an object store has no directories to make
    for name in names:
        pafs.copy_files(str(local / name), f"{path}/{name}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)


def remove(path: str | Path) -> None:
    """Delete a checkpoint (a local directory or a URI); nothing if it is already gone."""
    fs, p = storage.resolve(str(path), "checkpoint.storage_path")
    storage.remove_dir(fs, p)


def _write_atomic(target: Path, text: str) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, target)


def _fingerprint(f: Path) -> list:
    return [f.stat().st_size, sha256_file(f)]


def verify(path: str | Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong (the same answer on every rank)."""
    if storage.is_uri(str(path)):
        with storage.local_copy(str(path), "--resume") as local:
            return verify(local)
    p = Path(path)
    if not is_complete(p):
        return f"missing {STATE_FILE} or .metadata (half-written)"
    try:
        state = json.loads((p / STATE_FILE).read_text())
        problem = state_problem(state)
        return f"{STATE_FILE} {problem}" if problem else _files_problem(p, state["saved_by_ranks"])
    except (OSError, ValueError) as e:
        return f"unreadable state ({type(e).__name__}: {e})"
    except safe_dcp.UnsafeCheckpoint as e:
        return str(e)


def _files_problem(p: Path, ranks: int) -> str | None:
    """What is wrong with the files of the `ranks` saving ranks: a missing manifest, a file that does
    not match it, or a shard that `.metadata` reads but no manifest lists (hence never checksummed)."""
    listed: dict[str, Any] = {}
    for r in range(ranks):
        manifest = p / f"files-rank{r}.json"
        if not manifest.is_file():
            return f"missing {manifest.name} ({STATE_FILE} says saved_by_ranks={ranks})"
        entries = json.loads(manifest.read_text())
        if not isinstance(entries, dict) or not all(_is_checkpoint_file(name) for name in entries):
            return f"{manifest.name} lists something other than this checkpoint's shard files"
        listed.update(entries)
    for name, expected in listed.items():
        if (p / name).is_symlink():   # it would be read from wherever it points
            return f"{name} is a link, not a file of the checkpoint"
        if not (p / name).is_file() or _fingerprint(p / name) != expected:
            return f"{name} is missing or does not match its checksum"
    unlisted = (safe_dcp.shard_files(safe_dcp.read_metadata(p)) | {safe_dcp.METADATA_FILE}) - listed.keys()
    if unlisted:
        return f".metadata reads {sorted(unlisted)[:5]}, which no files-rank<r>.json of ranks 0..{ranks - 1} lists"
    return None


def _is_checkpoint_file(name: str) -> bool:
    # Manifest names come from the checkpoint: a path in one would be hashed outside its directory.
    return name == safe_dcp.METADATA_FILE or bool(safe_dcp.SHARD_NAME.fullmatch(name))


def first_valid(candidates: list[str]) -> str | None:
    """The newest candidate that verifies; warns naming each one skipped."""
    for i, path in enumerate(candidates):
        problem = verify(path)
        if problem is None:
            return path
        nxt = candidates[i + 1] if i + 1 < len(candidates) else "none (starting from scratch)"
        # raydl's line, on the console also from a Ray worker (raydl.driver.ray_output sends Ray's own to ray.log)
        log.warning(f"checkpoint {path} is not usable ({problem}); falling back to {nxt}")
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
    """The checkpoint's trainer state (a local path or a URI), checked against `checkpoint_state.STATE_SCHEMA`."""
    fs, p = storage.resolve(str(path), "--resume")
    if not storage.exists(fs, p):
        raise CheckpointError(f"resume path '{path}' does not exist. Fix: pass a run directory or one of its "
                              f"checkpoints (runs/<run>/train/step_NNNNNNNN).")
    if not is_complete(path):
        raise CheckpointError(f"'{path}' is not a complete raydl checkpoint (needs .metadata and {STATE_FILE}); it "
                              f"may be half-written. {FIX_EARLIER}.")
    state_file = storage.join(str(path), STATE_FILE)
    try:
        state = json.loads(storage.read_bytes(fs, f"{p}/{STATE_FILE}"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint state '{state_file}' is unreadable ({e}). {FIX_EARLIER}.") from None
    problem = state_problem(state)
    if problem:
        raise CheckpointError(f"checkpoint state '{state_file}' {problem} (edited or damaged). {FIX_EARLIER}.")
    return state


def check_compatible(state: dict[str, Any], fingerprint: dict[str, Any], path: str | Path) -> None:
    saved = state.get("model", {})
    if saved != fingerprint:
        raise CheckpointError(f"checkpoint '{path}' was saved from model {saved} but this run builds {fingerprint}. "
                              f"Fix: resume with the same model.name/model.size and dataset, or start a new run "
                              f"without --resume.{_untied_gpt2(saved)}")


def _untied_gpt2(saved: dict[str, Any]) -> str:
    if saved.get("name") != "gpt" or saved.get("size") != "gpt2":
        return ""
    return (" The gpt2 preset is GPT-2 124M since 2026-11-27 (head tied to the token embedding, vocabulary padded to "
            "a multiple of 64); a checkpoint of the earlier untied gpt2 (163M with GPT-2's vocabulary) resumes with "
            "--set model.options.tie_head=false, which builds that model again.")


def load(path: str | Path, model: nn.Module, optimizer, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """Load model + optimizer shards for this rank's part of the model; returns the trainer state.

    Nothing in the checkpoint runs: `.metadata` and the non-tensor entries go through `safe_dcp`.
    A URI is downloaded first (by every rank: each reads the shards of its part of the model)."""
    if storage.is_uri(str(path)):
        with storage.local_copy(str(path), "--resume") as local:
            return load(local, model, optimizer, fingerprint)
    state = read_state(path)
    check_compatible(state, fingerprint, path)
    with _loading(path):
        reader = safe_dcp.CheckedReader(path)
        nested = NESTED_KEY in reader.metadata.state_dict_metadata
        options = StateDictOptions() if nested else FLAT_OPTIMIZER
        with states_one_by_one(optimizer):
            msd, osd = get_state_dict(model, optimizer, options=options)
        msd, tied = trained_part(msd, model), tied_pairs(model)
        states = osd if nested else optimizer_states(osd)
        read = {"model": stored(msd, tied), "optim": stored(states, tied)}
        dcp.load(read, storage_reader=reader, planner=safe_dcp.WeightsOnlyPlanner())
        msd, osd = unstored(msd, read["model"], tied), {**osd, **unstored(states, read["optim"], tied)}
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                       options=dataclasses.replace(options, strict=not adapted(model)))
    return state


def load_weights(path: str | Path, model: nn.Module) -> None:
    """Only the model's tensors of a checkpoint, into this rank's part of the model (train.init_from): no optimizer
    state, no trainer state. The driver checked that they fit (raydl.driver.init_from)."""
    if storage.is_uri(str(path)):
        with storage.local_copy(str(path), "train.init_from") as local:
            return load_weights(local, model)
    with _loading(path):
        # A LoRA model's base weights, under the names the model had without adapters (the checkpoint's).
        msd = {base_name(key): value for key, value in get_model_state_dict(model).items() if not is_adapter(key)}
        dcp.load({"model": msd}, storage_reader=safe_dcp.CheckedReader(path), planner=safe_dcp.WeightsOnlyPlanner())
        if adapted(model):
            msd = {key: msd[base_name(key)] for key in get_model_state_dict(model) if not is_adapter(key)}
        set_model_state_dict(model, msd, options=StateDictOptions(strict=not adapted(model)))


@contextlib.contextmanager
def _loading(path: str | Path) -> Iterator[None]:
    """DCP's errors while loading `path` as a CheckpointError (memory errors as they are)."""
    try:
        yield
    # DCP raises assorted errors on missing/corrupt shards, each rank's wrapped in a CheckpointException
    # (a BaseException whose text is a traceback).
    except (Exception, CheckpointException) as e:
        cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        if is_out_of_memory(cause):   # the checkpoint is fine: the worker is short of memory (raydl.train.loop)
            raise cause from None
        if isinstance(cause, safe_dcp.UnsafeCheckpoint):
            raise CheckpointError(f"checkpoint '{path}' is not usable: {cause}. {FIX_EARLIER}, one you trust.") from None
        raise CheckpointError(f"checkpoint '{path}' could not be loaded ({type(cause).__name__}: {str(cause)[:300]}). "
                              f"{FIX_EARLIER}.") from cause


def all_complete(root: str | Path) -> list[Path] | list[str]:
    """Complete checkpoints under a run directory or checkpoint storage (or `root` itself if it is one),
    newest first: Paths, or URIs for a URI `root`."""
    if storage.is_uri(str(root)):
        return _all_complete_remote(str(root))
    root = Path(root)
    if is_complete(root):
        return [root]
    candidates = list(root.glob("train/step_*")) + list(root.glob("step_*"))
    return sorted((c for c in candidates if is_complete(c)), key=lambda c: c.name, reverse=True)


def _all_complete_remote(root: str) -> list[str]:
    if is_complete(root):
        return [root]
    fs, p = storage.resolve(root, "--resume")
    found = [i for d in (p, f"{p}/train") for i in fs.get_file_info(pafs.FileSelector(d, allow_not_found=True))]
    candidates = [storage.uri(fs, i.path) for i in found
                  if i.type == pafs.FileType.Directory and i.base_name.startswith("step_")]
    return sorted((c for c in candidates if is_complete(c)), key=dir_name, reverse=True)


def find_latest(root: str | Path) -> Path | str | None:
    complete = all_complete(root)
    return complete[0] if complete else None


def resolve_resume(path: str) -> Path | str:
    """The checkpoint to resume from: `path` itself if it is one (an error saying why if it is unusable),
    else the newest usable checkpoint of the run directory or checkpoint storage `path` (a local path or a
    URI; a URI stays one)."""
    fs, p = storage.check(path, "--resume")
    if not storage.exists(fs, p):
        raise CheckpointError(f"--resume path '{path}' does not exist. Fix: pass a run directory or a checkpoint "
                              f"directory inside it (train/step_NNNNNNNN).")
    if is_complete(path):
        problem = verify(path)
        if problem:
            raise CheckpointError(f"checkpoint '{path}' is not usable: {problem}. {FIX_EARLIER}, or pass the run "
                                  f"directory to take its newest usable checkpoint.")
        return absolute(path)
    latest = first_valid([str(c) for c in all_complete(path)])
    if latest is None:
        raise CheckpointError(f"--resume path '{path}' holds no usable checkpoint (a warning above names each one "
                              f"skipped and why). Fix: pass a run directory that saved at least one intact "
                              f"checkpoint, or start without --resume.")
    return absolute(latest)


def absolute(path: str | Path) -> Path | str:
    return str(path) if storage.is_uri(str(path)) else Path(path).resolve()
