"""A raydl checkpoint's model tensors as Hugging Face safetensors shards, one shard in memory at a time.

    model-00001-of-0000N.safetensors ...  + model.safetensors.index.json   (one file: model.safetensors)

Each shard's tensors are read from the DCP checkpoint by one `dcp.load` of just those entries (DCP reads
only their byte ranges, whatever layout saved them), written, and freed: the exporting process holds at
most `max_shard_bytes` (or one larger tensor), never the whole model.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raydl.train import safe_dcp

__all__ = ["MAX_SHARD_BYTES", "save_safetensors", "write_shards"]

MAX_SHARD_BYTES = 2**30
MODEL_KEY = "model"   # raydl.train.checkpoint saves {"model": ..., "optim": ...}


def write_shards(checkpoint: str | Path, names: dict[str, str], out: Path, *, max_shard_bytes: int | None = None) -> int:
    """Write the checkpoint's model entries under their Hugging Face names (`names`: raydl name -> HF name,
    in the order to write) into `out`; returns the bytes written."""
    metadata = safe_dcp.read_metadata(checkpoint).state_dict_metadata
    sizes = {name: _entry(metadata, name) for name in names}
    shards = list(_group(sizes, max_shard_bytes or MAX_SHARD_BYTES))
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        tensors = _read(checkpoint, {name: sizes[name] for name in shard})
        save_safetensors(out / file, {names[name]: t for name, t in tensors.items()})
        weight_map.update({names[name]: file for name in shard})
        del tensors
    total = sum(sizes[n].properties.dtype.itemsize * _numel(sizes[n].size) for n in names)
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def _entry(metadata, name: str) -> TensorStorageMetadata:
    entry = metadata.get(f"{MODEL_KEY}.{name}")
    if not isinstance(entry, TensorStorageMetadata):   # the checkpoint's fingerprint matched: a raydl bug
        raise RuntimeError(f"checkpoint has no tensor entry {MODEL_KEY}.{name}")
    return entry


def _numel(size: torch.Size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _group(sizes: dict[str, TensorStorageMetadata], limit: int) -> Iterator[list[str]]:
    """Consecutive names in shards of at most `limit` bytes (a larger tensor alone in its own)."""
    shard, used = [], 0
    for name, entry in sizes.items():
        nbytes = entry.properties.dtype.itemsize * _numel(entry.size)
        if shard and used + nbytes > limit:
            yield shard
            shard, used = [], 0
        shard.append(name)
        used += nbytes
    if shard:
        yield shard


def _read(checkpoint: str | Path, entries: dict[str, TensorStorageMetadata]) -> dict[str, torch.Tensor]:
    state = {name: torch.empty(e.size, dtype=e.properties.dtype) for name, e in entries.items()}
    with warnings.catch_warnings():   # DCP's note that it loads without a process group: that is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({MODEL_KEY: state}, storage_reader=safe_dcp.CheckedReader(checkpoint),
                 planner=safe_dcp.WeightsOnlyPlanner(), no_dist=True)
    return state


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})   # transformers refuses files without a format
