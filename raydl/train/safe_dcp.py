"""Reading torch.distributed.checkpoint (DCP) files without running code from them.

torch 2.13's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and its
DefaultLoadPlanner loads every non-tensor entry (any state that is not a tensor; in raydl's
checkpoints before 2026-11-28 also the optimizer's hyperparameters and parameter-name lists) with
`torch.load(weights_only=False)`: a crafted checkpoint would run
arbitrary code on `--resume`. Here `.metadata` is unpickled by an allowlist of the classes a DCP
metadata file holds, its storage entries must name shard files of its own directory, and
non-tensor entries load with `weights_only=True` (tensor entries already do).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"
SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")   # what FileSystemWriter names a rank's shard files

# Every class of torch/distributed/checkpoint/metadata.py, and the globals that pickling the
# metadata of raydl's real checkpoints (FSDP2/DTensor and pipeline stages; AdamW, SGD; fp16
# scaler) produced: the storage-info dataclass, torch.Size, layouts (rebuilt by name through
# torch.serialization._get_layout) and the checkpoint_id path. Dtypes are allowed separately.
_ALLOWED_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}
_TORCH_DTYPES = {name for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


class UnsafeCheckpoint(Exception):
    """A `.metadata` file that is unreadable, asks for a class outside the allowlist or points
    outside its directory, or an entry that is not plain data. The message names it and what is wrong."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and name in _TORCH_DTYPES):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"'{self.path}' asks to build {module}.{name}, which no DCP metadata holds "
                             f"(a crafted or damaged file); nothing of it was run")


def read_metadata(checkpoint: str | Path) -> Metadata:
    """The checkpoint's DCP metadata, built from allowlisted classes only and checked to read
    nothing but shard files of `checkpoint` itself."""
    path = Path(checkpoint) / METADATA_FILE
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:   # a damaged pickle fails in many ways (EOFError, UnpicklingError, TypeError, ...)
        raise UnsafeCheckpoint(f"'{path}' is unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    problem = _structure_problem(metadata)
    if problem:
        raise UnsafeCheckpoint(f"'{path}' {problem}")
    return metadata


def _structure_problem(metadata: Any) -> str | None:
    if not (isinstance(metadata, Metadata) and isinstance(metadata.storage_data, dict)
            and isinstance(metadata.state_dict_metadata, dict)):
        return "is not DCP metadata"
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            return "holds a storage entry that is not DCP's"
        if not SHARD_NAME.fullmatch(info.relative_path):
            return f"points at {info.relative_path[:100]!r}, not a shard file (__<rank>_<n>.distcp) of its directory"
        if info.transform_descriptors:   # compression etc.: raydl never writes them
            return f"asks for stream transforms {list(info.transform_descriptors)[:5]}, which raydl never writes"
    return None


def shard_files(metadata: Metadata) -> set[str]:
    """The shard files `metadata` reads from (names inside its directory)."""
    return {info.relative_path for info in metadata.storage_data.values()}


class CheckedReader(FileSystemReader):
    """A FileSystemReader whose metadata comes from `read_metadata`, read once when it is built so
    that a refused file raises `UnsafeCheckpoint` here instead of deep inside `dcp.load`."""

    def __init__(self, checkpoint: str | Path):
        super().__init__(checkpoint)
        self.metadata = read_metadata(checkpoint)

    # No **kwargs: DCP then never falls back to per-rank `__<rank>.metadata` files, which raydl
    # does not write.
    def read_metadata(self) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, except that non-tensor entries load with `torch.load(weights_only=True)`:
    plain data (numbers, strings, tuples, lists, dicts, tensors), never code."""

    def load_bytes(self, read_item, value) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))
            raise UnsafeCheckpoint(f"its entry '{read_item.dest_index.fqn}' asks to build "
                                   f"{found[1] if found else 'an object'}, which is not plain data; nothing of it "
                                   f"was run") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
