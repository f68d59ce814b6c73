"""Parquet inputs of `raydl data prepare`: which task a table holds, its rows, and its metadata.

A tokens table (input_ids [+ labels] as fixed-size lists) or an images table (image + label)
passes through with its columns; a string column given by --column is tokenized like text
(raydl.data.prepare_text).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydl.data.dataset import is_parquet
from raydl.data.input_files import Progress
from raydl.errors import DataError


def parquet_task(files: list[Path], column: str) -> str:
    """tokens or images (passed through), or text (the --column string column is tokenized)."""
    schema = _common_schema(files)
    names = set(schema.names) - {"id"}
    if "input_ids" in names:
        return "tokens"
    if {"image", "label"} <= names:
        return "images"
    if column in names and (pa.types.is_string(schema.field(column).type)
                            or pa.types.is_large_string(schema.field(column).type)):
        return "text"
    raise DataError(f"parquet '{files[0]}' has columns {', '.join(schema.names)}: raydl cannot tell the task. "
                    f"Fix: provide input_ids/labels (tokens), image/label (images), or a text column via "
                    f"--column NAME.")


def _common_schema(files: list[Path]) -> pa.Schema:
    first = None
    for path in files:
        if not is_parquet(pafs.LocalFileSystem(), str(path)):
            raise DataError(f"'{path}' is not a parquet file (no PAR1 magic bytes). Fix: remove it from the input, "
                            f"or prepare it with --from text|jsonl|images.")
        try:
            schema = pq.read_schema(path).remove_metadata()
        except pa.ArrowException as e:
            raise DataError(f"parquet file '{path}' cannot be read ({e}). Fix: remove or re-export it.") from None
        if first is None:
            first = (path, schema)
        elif not schema.equals(first[1]):
            diff = set(map(str, schema)) ^ set(map(str, first[1]))
            raise DataError(f"parquet files '{first[0]}' and '{path}' have different schemas (differing fields: "
                            f"{', '.join(sorted(diff))}). Fix: prepare them as separate datasets, or convert them "
                            f"to one schema.")
    return first[1]


def parquet_batches(files: list[Path], progress: Progress, columns=None) -> Iterator[pa.RecordBatch]:
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns):
            progress.update(nbytes=batch.nbytes)
            yield batch
        progress.update(files=1)


def parquet_passthrough(files: list[Path], progress: Progress) -> Iterator[pa.Table]:
    keep = [n for n in pq.read_schema(files[0]).names if n != "id"]     # raydl assigns its own stable ids
    for batch in parquet_batches(files, progress, keep):
        yield pa.Table.from_batches([batch])


def infer_meta(task: str, schema: pa.Schema, stats: dict) -> dict:
    """Model metadata of a passed-through parquet table, from its schema and the streamed maxima."""
    if task == "tokens":
        t = schema.field("input_ids").type
        if not pa.types.is_fixed_size_list(t):
            raise DataError(f"column input_ids is {t}, not a fixed-size list. Fix: write it as "
                            f"pa.FixedSizeListArray (one fixed sequence length).")
        return {"task": "tokens", "vocab_size": int(stats["max_token"]) + 1, "seq_len": t.list_size}
    size = schema.field("image").type.list_size // 3
    side = math.isqrt(size)
    if side * side != size:
        raise DataError(f"column image has {size * 3} values per row, not 3xHxH. Fix: store square RGB images "
                        f"flattened as a fixed-size list of uint8.")
    return {"task": "images", "num_classes": int(stats["max_label"]) + 1, "image_shape": [3, side, side]}
