"""A raydl dataset on disk: parquet shards per split plus `manifest.json`.

    <dir>/manifest.json       {"format", "task", model metadata, "splits": {name: {"rows", "shards": [...]}}}
    <dir>/train-00000.parquet ...   each shard has an `id` column (stable sample id) and row groups
    <dir>/eval-00000.parquet  ...   of `ROW_GROUP_ROWS` rows, the unit the loader reads and shuffles.

`path` may be local or any pyarrow filesystem URI (s3://, gs://, hdfs://).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydl.config import JobConfig
from raydl.data.builtin import GENERATORS
from raydl.errors import DataError

FORMAT = "raydl-parquet/1"
ROW_GROUP_ROWS = 256


@dataclass(frozen=True)
class Shard:
    file: str          # path relative to the dataset root
    rows: int
    row_groups: tuple[int, ...]   # rows in each row group


@dataclass(frozen=True)
class DatasetInfo:
    root: str          # URI or local path
    meta: dict[str, Any]
    splits: dict[str, tuple[Shard, ...]]

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self.splits[split])

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        return pafs.FileSystem.from_uri(self.root) if "://" in self.root else (pafs.LocalFileSystem(), self.root)


def write_split(root: Path, split: str, tables, *, shard_rows: int) -> list[dict[str, Any]]:
    """Write an iterable of tables as shards of `shard_rows` rows; returns manifest entries."""
    shards, buffer, rows_buffered = [], [], 0

    def flush():
        nonlocal buffer, rows_buffered
        table = pa.concat_tables(buffer)
        name = f"{split}-{len(shards):05d}.parquet"
        pq.write_table(table, root / name, row_group_size=ROW_GROUP_ROWS)
        digest = hashlib.sha256((root / name).read_bytes()).hexdigest()
        groups = [min(ROW_GROUP_ROWS, table.num_rows - i) for i in range(0, table.num_rows, ROW_GROUP_ROWS)]
        shards.append({"file": name, "rows": table.num_rows, "row_groups": groups, "sha256": digest})
        buffer, rows_buffered = [], 0

    for table in tables:
        while table.num_rows:
            take = min(shard_rows - rows_buffered, table.num_rows)
            buffer.append(table.slice(0, take))
            rows_buffered += take
            table = table.slice(take)
            if rows_buffered == shard_rows:
                flush()
    if rows_buffered:
        flush()
    return shards


def write_manifest(root: Path, meta: dict[str, Any], splits: dict[str, list[dict[str, Any]]]) -> None:
    manifest = {"format": FORMAT, **meta,
                "splits": {k: {"rows": sum(s["rows"] for s in v), "shards": v} for k, v in splits.items()}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1))


def ensure_builtin(cfg: JobConfig, task: str) -> str:
    """Generate the built-in dataset for `task` once; safe if several processes race."""
    d = cfg.data
    target = Path(d.cache_dir) / f"{task}-seed{cfg.train.seed}-n{d.builtin_samples}-s{d.shard_rows}"
    if (target / "manifest.json").exists():
        return str(target)
    make_table, meta = GENERATORS[task]
    num_eval = max(ROW_GROUP_ROWS, int(d.builtin_samples * d.eval_fraction))
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    ids = np.arange(d.builtin_samples)
    batches = lambda sel: (make_table(sel[i:i + 4096], cfg.train.seed) for i in range(0, len(sel), 4096))
    splits = {"train": write_split(tmp, "train", batches(ids[num_eval:]), shard_rows=d.shard_rows),
              "eval": write_split(tmp, "eval", batches(ids[:num_eval]), shard_rows=d.shard_rows)}
    write_manifest(tmp, meta, splits)
    try:
        os.rename(tmp, target)   # atomic publish: readers see all of it or nothing
    except OSError:              # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def resolve_path(cfg: JobConfig, task: str) -> str:
    return ensure_builtin(cfg, task) if cfg.data.path == "builtin" else cfg.data.path


def open_dataset(path: str) -> DatasetInfo:
    fs, root = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataError(f"data.path '{path}' does not exist. Fix: point data.path at a dataset directory made by "
                        f"`raydl data prepare`, or use data.path=builtin.")
    manifest_path = f"{root.rstrip('/')}/manifest.json"
    if fs.get_file_info(manifest_path).type == pafs.FileType.NotFound:
        raise DataError(f"data.path '{path}' has no manifest.json, so it is not a raydl dataset. Fix: convert it "
                        f"with `raydl data prepare --from parquet {path} --out DIR` (or text/jsonl/images).")
    with fs.open_input_stream(manifest_path) as f:
        manifest = json.loads(f.read())
    splits = {name: tuple(Shard(s["file"], s["rows"], tuple(s["row_groups"])) for s in split["shards"])
              for name, split in manifest.pop("splits").items()}
    if not splits.get("train"):
        raise DataError(f"dataset '{path}' has no rows in its train split. Fix: prepare it again with data in it.")
    return DatasetInfo(root=path, meta=manifest, splits=splits)


def check_task(info: DatasetInfo, task: str, model_name: str) -> None:
    if info.meta.get("task") != task:
        raise DataError(f"dataset '{info.root}' holds {info.meta.get('task')!r} data but model '{model_name}' "
                        f"trains on {task!r} data. Fix: use a {task} dataset or pick the matching model.name.")
