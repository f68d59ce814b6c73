"""A raydl dataset on disk: parquet shards per split plus `manifest.json`.

    <dir>/manifest.json       {"format", "task", model metadata, "splits": {name: {"rows", "shards": [...]}}}
    <dir>/train-00000.parquet ...   each shard has an `id` column (stable sample id) and row groups
    <dir>/eval-00000.parquet  ...   of `ROW_GROUP_ROWS` rows, the unit the loader reads and shuffles.

`path` may be local or any URI raydl.storage opens (s3://, gs://, hdfs://, fsspec's). A dataset appears
whole or not at all: locally it is written beside its directory and renamed into place; on an object
store (no rename) its shards are written first and manifest.json, which makes it a dataset, last.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydl import storage
from raydl.config import JobConfig
from raydl.data.builtin import GENERATORS
from raydl.data.columns import MASK_SUFFIX, VARIABLE, describe
from raydl.data.manifest import parse_manifest
from raydl.errors import DataError, one_line

FORMAT = "raydl-parquet/1"
ROW_GROUP_ROWS = 256
IGNORE_LABEL = -100   # a label that is no label: the losses' ignore_index


@dataclass(frozen=True)
class Shard:
    file: str          # path relative to the dataset root
    rows: int
    row_groups: tuple[int, ...]   # rows in each row group
    sha256: str | None = None


@dataclass(frozen=True)
class DatasetInfo:
    root: str          # URI or local path
    meta: dict[str, Any]
    splits: dict[str, tuple[Shard, ...]]
    digest: str = ""   # sha256 of manifest.json (which names every shard's sha256): the dataset's content

    def rows(self, split: str) -> int:
        return sum(s.rows for s in self.splits[split])

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        return storage.resolve(self.root, "data.path")

    @functools.cached_property
    def shard_paths(self) -> dict[str, tuple[str, ...]]:
        """Every shard's path, by split; each checked once to stay inside the dataset directory."""
        return {split: tuple(self.inside(s.file, f"splits.{split}.shards[{i}].file") for i, s in enumerate(shards))
                for split, shards in self.splits.items()}

    def inside(self, relative: Any, entry: str) -> str:
        """The path of manifest entry `entry` (a file name relative to the dataset directory), refused
        unless it stays inside that directory: a manifest comes from elsewhere and must not make raydl
        read /etc/passwd, another dataset, or whatever a symlink points at."""
        fs, root = self.filesystem()
        parts = PurePosixPath(relative).parts if isinstance(relative, str) else ()
        path = f"{root.rstrip('/')}/{relative}"
        escapes = (not parts or PurePosixPath(relative).is_absolute() or ".." in parts or "://" in relative
                   or "\\" in relative or "\0" in relative)
        if not escapes and isinstance(fs, pafs.LocalFileSystem):
            real_root = os.path.realpath(root)
            escapes = os.path.commonpath([real_root, os.path.realpath(path)]) != real_root
        if escapes:
            raise DataError(f"'{root.rstrip('/')}/manifest.json' entry {entry} = {relative!r} is not a file inside "
                            f"the dataset directory (an absolute path, '..', or a symlink out of it); raydl reads only "
                            f"files inside it. Fix: re-create the dataset with `raydl data prepare`, or make the entry "
                            f"a file name inside '{root}'.")
        return path


class ShardWriter:
    """Writes a stream of tables as shards of `shard_rows` rows; holds at most one shard in memory."""

    def __init__(self, fs: pafs.FileSystem, root: str, split: str, *, shard_rows: int):
        self.fs, self.root, self.split, self.shard_rows = fs, root, split, shard_rows
        self.shards: list[dict[str, Any]] = []
        self.schema: pa.Schema | None = None
        self._buffer: list[pa.Table] = []
        self._rows = 0

    def add(self, table: pa.Table) -> None:
        while table.num_rows:
            take = min(self.shard_rows - self._rows, table.num_rows)
            self._buffer.append(table.slice(0, take))
            self._rows += take
            table = table.slice(take)
            if self._rows == self.shard_rows:
                self._flush()

    def close(self) -> list[dict[str, Any]]:
        if self._rows:
            self._flush()
        return self.shards

    def _flush(self) -> None:
        table = pa.concat_tables(self._buffer)
        self.schema = self.schema or table.schema
        name = f"{self.split}-{len(self.shards):05d}.parquet"
        # Encoded in memory (a shard is held whole anyway) and hashed there: no second read of the file,
        # which on an object store would be a second download.
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS)
        data = sink.getvalue()
        storage.write_bytes(self.fs, f"{self.root}/{name}", data)
        groups = [min(ROW_GROUP_ROWS, table.num_rows - i) for i in range(0, table.num_rows, ROW_GROUP_ROWS)]
        self.shards.append({"file": name, "rows": table.num_rows, "row_groups": groups,
                            "sha256": hashlib.sha256(data).hexdigest()})
        self._buffer, self._rows = [], 0


def write_split(fs: pafs.FileSystem, root: str, split: str, tables, *, shard_rows: int) -> list[dict[str, Any]]:
    """Write an iterable of tables as shards of `shard_rows` rows; returns manifest entries."""
    writer = ShardWriter(fs, root, split, shard_rows=shard_rows)
    for table in tables:
        writer.add(table)
    return writer.close()


def schema_dict(schema: pa.Schema) -> dict[str, str]:
    return {f.name: str(f.type) for f in schema}


def write_manifest(fs: pafs.FileSystem, root: str, meta: dict[str, Any],
                   splits: dict[str, list[dict[str, Any]]]) -> None:
    """Written after every shard: a dataset without it is not one (the last step of a dataset's writing)."""
    first = next(s for shards in splits.values() for s in shards)
    schema = read_footer(fs, f"{root}/{first['file']}").schema.to_arrow_schema()
    manifest = {"format": FORMAT, **meta, "schema": schema_dict(schema),
                "rows": sum(s["rows"] for v in splits.values() for s in v),
                "splits": {k: {"rows": sum(s["rows"] for s in v), "shards": v} for k, v in splits.items()}}
    storage.write_bytes(fs, f"{root}/manifest.json", json.dumps(manifest, indent=1).encode())


def staging_dir(fs: pafs.FileSystem, root: str) -> str:
    """Where a dataset bound for `root` is written: a hidden local sibling that `publish` renames (atomic), or
    on an object store `root` itself, where the manifest written last is what publishes it."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return root
    parent, name = os.path.split(os.path.abspath(root))
    return os.path.join(parent, f".{name}.{uuid.uuid4().hex[:8]}")


def publish(staging: str, root: str) -> None:
    """Make the dataset written (manifest last) in `staging` visible at `root`, which is missing or empty."""
    if staging == root:
        return
    if os.path.isdir(root):
        os.rmdir(root)
    os.rename(staging, root)


def ensure_builtin(cfg: JobConfig, task: str) -> str:
    """Generate the built-in dataset for `task` once (in data.cache_dir, a path or URI); safe if several
    processes race (the same rows, and the same files: the last writer's manifest wins)."""
    d = cfg.data
    target = storage.join(d.cache_dir, f"{task}-seed{cfg.train.seed}-n{d.builtin_samples}-s{d.shard_rows}")
    fs, root = storage.check(target, "data.cache_dir")
    if storage.exists(fs, f"{root}/manifest.json"):
        return target
    make_table, meta = GENERATORS[task]
    num_eval = max(ROW_GROUP_ROWS, int(d.builtin_samples * d.eval_fraction))
    tmp = staging_dir(fs, root)
    fs.create_dir(tmp)
    ids = np.arange(d.builtin_samples)
    batches = lambda sel: (make_table(sel[i:i + 4096], cfg.train.seed) for i in range(0, len(sel), 4096))
    try:
        splits = {"train": write_split(fs, tmp, "train", batches(ids[num_eval:]), shard_rows=d.shard_rows),
                  "eval": write_split(fs, tmp, "eval", batches(ids[:num_eval]), shard_rows=d.shard_rows)}
        write_manifest(fs, tmp, meta, splits)
        publish(tmp, root)
    except OSError:
        if tmp == root or not storage.exists(fs, f"{root}/manifest.json"):
            raise
        storage.remove_dir(fs, tmp)   # another process published it first
    return target


def resolve_path(cfg: JobConfig, task: str) -> str:
    return ensure_builtin(cfg, task) if cfg.data.path == "builtin" else cfg.data.path


def is_parquet(fs: pafs.FileSystem, path: str) -> bool:
    """Parquet files start and end with the magic bytes PAR1."""
    size = fs.get_file_info(path).size or 0
    if size < 8:
        return False
    with fs.open_input_file(path) as f:
        head = f.read_at(4, 0)
        tail = f.read_at(4, size - 4)
    return head == tail == b"PAR1"


def _not_a_dataset(path: str, fs: pafs.FileSystem, root: str, kind: pafs.FileType) -> DataError:
    """The most helpful error for a data.path that has no manifest."""
    if kind == pafs.FileType.File:
        if is_parquet(fs, root):
            return DataError(f"data.path '{path}' is a single parquet file, not a raydl dataset directory. Fix: "
                             f"`raydl data prepare --from parquet {path} --out DIR`, then data.path=DIR.")
        return DataError(f"data.path '{path}' is not parquet (no PAR1 magic bytes). Fix: convert it with "
                         f"`raydl data prepare --from text|jsonl|images {path} --out DIR`, then data.path=DIR.")
    entries = fs.get_file_info(pafs.FileSelector(root))
    if not entries:
        return DataError(f"data.path '{path}' is an empty directory. Fix: prepare a dataset into it with "
                         f"`raydl data prepare ... --out {path}`, or point data.path at one.")
    return DataError(f"data.path '{path}' has no manifest.json, so it is not a raydl dataset ({len(entries)} "
                     f"entries, e.g. '{entries[0].base_name}'). Fix: convert it with `raydl data prepare --from "
                     f"parquet|text|jsonl|images {path} --out DIR`, then data.path=DIR.")


def open_dataset(path: str) -> DatasetInfo:
    fs, root = storage.check(path, "data.path")
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.NotFound:
        raise DataError(f"data.path '{path}' does not exist. Fix: point data.path at a dataset directory made by "
                        f"`raydl data prepare`, or use data.path=builtin.")
    manifest_path = f"{root.rstrip('/')}/manifest.json"
    if kind != pafs.FileType.Directory or fs.get_file_info(manifest_path).type == pafs.FileType.NotFound:
        raise _not_a_dataset(path, fs, root, kind)
    with fs.open_input_stream(manifest_path) as f:
        text = f.read()
        try:
            manifest, entries = parse_manifest(json.loads(text), manifest_path)
            splits = {name: tuple(Shard(s["file"], s["rows"], tuple(s["row_groups"]), s.get("sha256"))
                                  for s in shards)
                      for name, shards in entries.items()}
        except ValueError as e:   # not JSON (parse_manifest's DataError is a ValueError too)
            if isinstance(e, DataError):
                raise
            raise DataError(f"'{manifest_path}' is not a valid raydl manifest ({type(e).__name__}: {e}). Fix: "
                            f"re-create the dataset with `raydl data prepare`.") from None
    if not splits.get("train"):
        raise DataError(f"dataset '{path}' has no rows in its train split. Fix: prepare it again with data in it.")
    info = DatasetInfo(root=path, meta=manifest, splits=splits, digest=hashlib.sha256(text).hexdigest())
    files = [p for paths in info.shard_paths.values() for p in paths]
    missing = [i.path for i in fs.get_file_info(files) if i.type == pafs.FileType.NotFound]
    if missing:
        raise DataError(f"dataset '{path}' lists {len(missing)} shard(s) that do not exist, e.g. '{missing[0]}'. "
                        f"Fix: restore the files, or re-create the dataset with `raydl data prepare`.")
    if "schema" not in manifest:   # manifests written before raydl recorded it: read the first footer
        manifest["schema"] = schema_dict(read_footer(fs, files[0]).schema.to_arrow_schema())
    return info


def read_footer(fs: pafs.FileSystem, path: str) -> pq.FileMetaData:
    """A shard's parquet footer, or a DataError naming the shard."""
    try:
        with fs.open_input_file(path) as f:
            return pq.read_metadata(f)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"shard '{path}' cannot be read ({one_line(e)}): it is truncated or not parquet. Fix: re-create the "
                        f"dataset with `raydl data prepare`.") from None


def check_columns(info: DatasetInfo, columns: tuple[str, ...], model_name: str) -> None:
    """Each column a spec reads exists and is one a model can take as a tensor (raydl.data.columns):
    a DataError naming the first that is not, on the driver, before any worker starts."""
    if not columns:
        return
    fs, _ = info.filesystem()
    schema = read_footer(fs, info.shard_paths["train"][0]).schema.to_arrow_schema()
    tensors = describe(schema)
    masks = {n + MASK_SUFFIX for n, c in tensors.items() if c["shape"] == [VARIABLE]}
    for name in columns:
        if name in tensors or name in masks:
            continue
        if name not in schema.names:
            raise DataError(f"dataset '{info.root}' has no column {name!r}, which model '{model_name}' reads "
                            f"(ModelSpec.columns; the dataset has: {', '.join(schema.names)}). Fix: prepare a "
                            f"dataset with that column, or read the columns it has.")
        raise DataError(f"dataset '{info.root}' column {name!r} is {schema.field(name).type}, which model "
                        f"'{model_name}' reads (ModelSpec.columns) but no model can take as a tensor: raydl "
                        f"reads integer, float and bool scalars and lists of them. Fix: convert that column to "
                        f"numbers (e.g. category strings to integer codes) before `raydl data prepare`, or "
                        f"drop it from the spec's columns.")


# What each task's models read: columns (and manifest metadata the model is built from).
REQUIRED = {"tokens": (("id", "input_ids", "labels"), ("vocab_size", "seq_len")),
            "images": (("id", "image", "label"), ("num_classes", "image_shape"))}


def check_task(info: DatasetInfo, task: str, model_name: str) -> None:
    if info.meta.get("task") != task:
        raise DataError(f"dataset '{info.root}' holds {info.meta.get('task')!r} data but model '{model_name}' "
                        f"trains on {task!r} data. Fix: use a {task} dataset or pick the matching model.name.")
    columns, keys = REQUIRED[task]
    schema = info.meta.get("schema", {})
    missing = [c for c in columns if c not in schema]
    if missing:
        raise DataError(f"dataset '{info.root}' has no column(s) {', '.join(map(repr, missing))} that model "
                        f"'{model_name}' needs (it has: {', '.join(schema) or 'no schema in manifest.json'}). Fix: "
                        f"prepare it with `raydl data prepare --from ...`, which writes {', '.join(columns)}.")
    missing = [k for k in keys if k not in info.meta]
    if missing:
        raise DataError(f"dataset '{info.root}' manifest.json lacks {', '.join(missing)}, which model "
                        f"'{model_name}' is built from. Fix: re-create it with `raydl data prepare`.")
