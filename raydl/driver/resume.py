"""`--resume RUN`: the run's own config.yaml is the base; the user's --config and --set apply on top.

    raydl train --resume runs/raydl-20260101-120000                                # on, as it was, to its max_steps
    raydl train --resume runs/raydl-20260101-120000 --set train.max_steps=2000     # one field changed
    raydl train --resume s3://bucket/ckpt/raydl-20260101-120000-1a2b3c/run         # its record in a bucket

Each field that differs from the run's is named on one line at start. A change the checkpoint cannot take is
refused before Ray starts, naming the field: the model's shape (the fingerprint a checkpoint records), or the
dataset's content (the sha256 of its manifest.json, which names every shard's sha256 and its tokenizer; its path
may change, a copy in a bucket is the same dataset). The resumed run writes a new run directory (raydl never
writes over a run) whose summary.json names the checkpoint it continues (`resumed_from`).

Where a run's record is found, from what --resume names (`find_run`):
    RUN_DIR/config.yaml                       a run directory
    RUN_DIR/train/step_N, RUN_DIR/step_N      one of its checkpoints
    LOC/<run>-<id>/run/config.yaml            the record beside checkpoints in a bucket (raydl.metrics.run_mirror),
                                              for LOC/<run>-<id>/run, LOC/<run>-<id> and LOC/<run>-<id>/step_N
A checkpoint with no record beside it (a local checkpoint.storage_path) needs the config: --config and --set over
the defaults, as for a new run; a model it does not match is refused with that said.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raydl import storage
from raydl.errors import CheckpointError, ConfigError, RaydlError
from raydl.metrics.run_mirror import FOLDER as MIRROR_FOLDER

RUN_CONFIG = "config.yaml"
DATASET_FILE = "dataset.json"   # the dataset a run trained on: its path, manifest digest and tokenizer


@dataclass
class RunRecord:
    where: str                       # the run directory, or its record in a bucket
    tree: dict[str, Any]             # its config.yaml
    dataset: dict[str, Any] | None   # its dataset.json (runs before raydl wrote one: None)


def resumed_tree(resume: str, tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` (the user's --config, or {}) field by field over the config of the run `resume` names (over the
    defaults when no record of it is found); --set applies on top of this."""
    merged = base_tree(find_run(resume))
    for section, values in tree.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section].update(values)
        else:
            merged[section] = values   # build_config names what is wrong with it
    return merged


def find_run(resume: str) -> RunRecord | None:
    """The record of the run that `resume` (a run directory, a checkpoint, their places in a bucket) belongs to."""
    storage.check(str(resume), "--resume")   # a bucket that is missing or refuses us: one paragraph
    for where in _candidates(str(resume)):
        fs, path = storage.resolve(where, "--resume")
        if not storage.exists(fs, f"{path}/{RUN_CONFIG}"):
            continue
        tree = _parse(storage.read_bytes(fs, f"{path}/{RUN_CONFIG}"), storage.join(where, RUN_CONFIG), yaml.safe_load)
        dataset_at = f"{path}/{DATASET_FILE}"
        dataset = (_parse(storage.read_bytes(fs, dataset_at), storage.join(where, DATASET_FILE), json.loads)
                   if storage.exists(fs, dataset_at) else None)
        return RunRecord(where, tree, dataset)
    return None


def _candidates(resume: str) -> list[str]:
    """The directories that may hold the run's config.yaml, nearest first."""
    trimmed = resume.rstrip("/") or resume
    parent = posixpath.dirname(trimmed) if storage.is_uri(trimmed) else str(Path(trimmed).parent)
    found = [trimmed]
    if storage.is_uri(trimmed):
        found.append(storage.join(trimmed, MIRROR_FOLDER))              # LOC/<run>-<id>
    if _basename(trimmed).startswith("step_"):                          # a checkpoint
        found.append(storage.join(parent, MIRROR_FOLDER) if storage.is_uri(trimmed) else parent)
        if _basename(parent) == "train" and not storage.is_uri(trimmed):
            found.append(str(Path(parent).parent))                        # RUN_DIR/train/step_N
    return found


def _basename(location: str) -> str:
    return posixpath.basename(location.rstrip("/"))


def _parse(data: bytes, where: str, parse) -> dict[str, Any]:
    try:
        value = parse(data.decode("utf-8"))
    except (ValueError, yaml.YAMLError) as e:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RaydlError(f"'{where}' is not readable ({type(e).__name__}). Fix: resume from another run directory, "
                         f"or pass the run's config with --config.") from None
    if not isinstance(value, dict):
        raise RaydlError(f"'{where}' holds a {type(value).__name__}, not a mapping. Fix: resume from another run "
                         f"directory, or pass the run's config with --config.")
    return value


def base_tree(record: RunRecord | None) -> dict[str, Any]:
    """The config tree a resumed run starts from: the run's own, with its run directory left to choose anew."""
    if record is None:
        return {}
    # A section that is not a mapping stays as it is: build_config names it (the file may come from elsewhere).
    tree = {section: dict(values) if isinstance(values, dict) else values for section, values in record.tree.items()}
    if isinstance(tree.setdefault("run", {}), dict):
        tree["run"]["dir"] = ""   # a new run directory; run.dir set on top still picks one
    return tree


def flat(config: dict[str, Any]) -> dict[str, Any]:
    """{"section.key": value}, a mapping field's entries one by one ("model.options.width")."""
    out = {}
    for section, values in config.items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            if isinstance(value, dict) and value:
                out.update({f"{section}.{key}.{entry}": v for entry, v in value.items()})
            else:
                out[f"{section}.{key}"] = value
    return out


def config_diff(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, the run's value, this run's value) for each field that differs; run.dir is always chosen anew."""
    old, new = flat(before), flat(after)
    missing = object()
    return [(path, old.get(path), new.get(path)) for path in sorted(old.keys() | new.keys())
            if old.get(path, missing) != new.get(path, missing) and not path.startswith("run.dir")]


def diff_line(record: RunRecord, diff: list[tuple[str, Any, Any]]) -> str:
    if not diff:
        return f"resuming the run of {record.where} with its config unchanged"
    changes = ", ".join(f"{path} {old!r} -> {new!r}" for path, old, new in diff)
    return f"resuming the run of {record.where} with {len(diff)} field(s) changed: {changes}"


def dataset_record(path: str, digest: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {"path": path, "manifest_sha256": digest, "tokenizer": meta.get("tokenizer")}


def refusal(record: RunRecord | None, diff: list[tuple[str, Any, Any]], *, checkpoint: str,
            saved_model: dict[str, Any], built_model: dict[str, Any],
            dataset: dict[str, Any]) -> RaydlError | None:
    """Why this run cannot continue from `checkpoint` (an error naming the field), or None when it can."""
    if saved_model != built_model:
        changed = [d for d in diff if d[0].startswith(("model.", "data."))]
        if record is None:
            return CheckpointError(
                f"checkpoint '{checkpoint}' was saved from model {saved_model} but this run builds {built_model}, and "
                f"it has no run record beside it (config.yaml), so this run's config is --config/--set over the "
                f"defaults. Fix: resume from the run's directory (or its record in a bucket, LOC/<run>-<id>/run), or "
                f"pass the run's config with --config RUN_DIR/config.yaml.")
        if not changed:   # the run's own model fields: its code (or a model spec object) changed since
            return CheckpointError(f"checkpoint '{checkpoint}' was saved from model {saved_model} but the run's own "
                                   f"config now builds {built_model} (the model's code changed since). Fix: resume "
                                   f"with the code the run trained with, or start a new run without --resume.")
        return ConfigError(
            ", ".join(path for path, _, _ in changed),
            f"changes the model: {_changes(changed)} build {built_model}, but the checkpoint '{checkpoint}' holds "
            f"{saved_model}, so this run cannot continue it",
            "resume with the run's values (drop the --set or --config that changes them), or start a new run "
            "without --resume")
    saved = (record.dataset or {}) if record else {}
    if saved.get("manifest_sha256") and saved["manifest_sha256"] != dataset["manifest_sha256"]:
        field = next((path for path, _, _ in diff if path.startswith("data.")), "data.path")
        what = (f"its tokenizer is {dataset['tokenizer']!r}, the run's {saved.get('tokenizer')!r}"
                if dataset.get("tokenizer") != saved.get("tokenizer") else
                f"its manifest.json's sha256 is {dataset['manifest_sha256'][:12]}…, the run's "
                f"{saved['manifest_sha256'][:12]}…")
        return ConfigError(field, f"names the dataset '{dataset['path']}', which is not the one the run of "
                           f"{record.where} trained on ('{saved.get('path')}'): {what}, so its data position does "
                           f"not continue here", "resume with the run's dataset (the same manifest.json wherever it "
                           "is: a copy in a bucket is the same dataset), or start a new run without --resume")
    return None


def _changes(diff: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{path}={new!r} (the run's: {old!r})" for path, old, new in diff)
