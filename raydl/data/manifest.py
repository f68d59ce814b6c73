"""Reading a dataset's manifest.json, which comes from elsewhere: every field's type and range is
checked before anything uses it, so a bad manifest is one DataError naming the entry, never a traceback."""

from __future__ import annotations

from typing import Any

from raydl.errors import DataError

# Model metadata a manifest may carry, and what each must be.
POSITIVE_INT_KEYS = ("vocab_size", "seq_len", "num_classes")


def parse_manifest(manifest: Any, where: str) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """(metadata, {split: [shard entries]}) of a parsed manifest.json, or a DataError naming the bad entry."""
    _require(isinstance(manifest, dict), where, "the file", "is not a JSON object")
    meta = dict(manifest)
    splits = meta.pop("splits", None)
    _require(isinstance(splits, dict) and splits, where, "splits", "is missing or not a mapping of splits")
    for key in POSITIVE_INT_KEYS:
        if key in meta:
            _require(_is_int(meta[key]) and meta[key] > 0, where, key, f"is {meta[key]!r}, not a positive integer")
    if "image_shape" in meta:
        shape = meta["image_shape"]
        _require(isinstance(shape, list) and len(shape) == 3 and all(_is_int(d) and d > 0 for d in shape),
                 where, "image_shape", f"is {shape!r}, not [channels, height, width]")
    for key in ("task", "tokenizer"):
        if key in meta:
            _require(isinstance(meta[key], str), where, key, f"is {meta[key]!r}, not a string")
    if "schema" in meta:
        _require(isinstance(meta["schema"], dict), where, "schema", "is not a mapping of column names")
    if "columns" in meta:
        _check_columns(meta["columns"], where)
    return meta, {str(name): _shards(split, f"splits.{name}", where) for name, split in splits.items()}


def _check_columns(columns: Any, where: str) -> None:
    """A table's tensor columns: {name: {"dtype": str, "shape": [] | [size] | [-1]}}."""
    _require(isinstance(columns, dict), where, "columns", "is not a mapping of column names")
    for name, column in columns.items():
        ok = (isinstance(column, dict) and isinstance(column.get("dtype"), str)
              and isinstance(column.get("shape"), list) and len(column["shape"]) <= 1
              and all(_is_int(d) and (d > 0 or d == -1) for d in column["shape"]))
        _require(ok, where, f"columns.{name}", f"is {column!r}, not {{dtype, shape}}")


def _shards(split: Any, entry: str, where: str) -> list[dict[str, Any]]:
    _require(isinstance(split, dict) and isinstance(split.get("shards"), list), where, entry,
             "is not a mapping with a list of shards")
    return [_shard(s, f"{entry}.shards[{i}]", where) for i, s in enumerate(split["shards"])]


def _shard(shard: Any, entry: str, where: str) -> dict[str, Any]:
    _require(isinstance(shard, dict), where, entry, "is not a mapping")
    _require(isinstance(shard.get("file"), str) and shard["file"], where, f"{entry}.file", "is not a file name")
    rows, groups = shard.get("rows"), shard.get("row_groups")
    _require(_is_int(rows) and rows >= 0, where, f"{entry}.rows", f"is {rows!r}, not a row count")
    _require(isinstance(groups, list) and all(_is_int(g) and g > 0 for g in groups) and sum(groups) == rows,
             where, f"{entry}.row_groups", f"is {groups!r}, not positive row counts adding up to rows={rows}")
    sha = shard.get("sha256")
    _require(sha is None or isinstance(sha, str), where, f"{entry}.sha256", f"is {sha!r}, not a hex digest")
    return shard


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, where: str, entry: str, problem: str) -> None:
    if not ok:
        raise DataError(f"'{where}' entry {entry} {problem}, so it is not a valid raydl manifest. Fix: re-create the "
                        f"dataset with `raydl data prepare`, or correct that entry.")


def manifest_digest(root: str) -> str | None:
    """sha256 of the local dataset `root`'s manifest.json (which names every shard's sha256), None if it has none:
    two nodes hold the same dataset when these agree."""
    import hashlib
    from pathlib import Path

    path = Path(root) / "manifest.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
