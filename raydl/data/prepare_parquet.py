"""Parquet inputs of `raydl data prepare`: which task a table holds, its rows, and its metadata.

A tokens table (input_ids [+ labels] as fixed-size lists) or an images table (image + label)
passes through with its columns; a string column given by --column is tokenized like text
(raydl.data.prepare_text). Any other table (or any table with --keep-columns) is a `table`
dataset: every column kept, the tensor ones (raydl.data.columns) listed in the manifest's
`columns` for the model's build.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydl.data.columns import MASK_SUFFIX, VARIABLE, describe
from raydl.data.dataset import IGNORE_LABEL, is_parquet
from raydl.data.input_files import Progress
from raydl.errors import DataError, one_line


def parquet_task(files: list[Path], column: str, *, keep_columns: bool = False) -> str:
    """tokens or images (passed through), text (the --column string column is tokenized), or table: any
    other table, or any table at all with `keep_columns`, passed through with every column."""
    schema = _common_schema(files)
    names = set(schema.names) - {"id"}
    if keep_columns:
        return _check_table(files[0], schema)
    if "input_ids" in names:
        _check_fixed_size(files[0], schema, [n for n in ("input_ids", "labels") if n in names])
        return "tokens"
    if {"image", "label"} <= names:
        _check_fixed_size(files[0], schema, ["image"])
        if image_side(schema) is None:
            raise DataError(f"parquet '{files[0]}' column image has {schema.field('image').type.list_size} values "
                            f"per row, not 3xHxH. Fix: store square RGB images flattened as a fixed-size list of "
                            f"uint8.")
        return "images"
    if column in names and (pa.types.is_string(schema.field(column).type)
                            or pa.types.is_large_string(schema.field(column).type)):
        return "text"
    return _check_table(files[0], schema)


def _check_table(path: Path, schema: pa.Schema) -> str:
    """A generic table needs a column a model can read, and no column named like another's padding mask."""
    tensors = describe(schema.remove(schema.get_field_index("id")) if "id" in schema.names else schema)
    if not tensors:
        raise DataError(f"parquet '{path}' has columns {', '.join(schema.names)}, none of them numbers (integer, "
                        f"float or bool scalars, or lists of them), so no model can read it. Fix: add numeric "
                        f"columns, or give a text column via --column NAME to tokenize it.")
    clashing = [n for n, c in tensors.items() if c["shape"] == [VARIABLE] and n + MASK_SUFFIX in schema.names]
    if clashing:
        raise DataError(f"parquet '{path}' column {clashing[0]} is a variable-length list, whose batches carry a "
                        f"mask named {clashing[0] + MASK_SUFFIX}, but the table already has a column of that "
                        f"name. Fix: rename that column.")
    return "table"


def _check_fixed_size(path: Path, schema: pa.Schema, columns: list[str]) -> None:
    for name in columns:
        kind = schema.field(name).type
        if not pa.types.is_fixed_size_list(kind):
            raise DataError(f"parquet '{path}' column {name} is {kind}, whose rows may differ in length (images of "
                            f"different sizes, sequences of different lengths), but a model takes one shape. Fix: "
                            f"give every row the same shape (resize the images, pack the tokens) and write the "
                            f"column as a fixed-size list (pa.FixedSizeListArray).")


def image_side(schema: pa.Schema) -> int | None:
    """H of an image column of 3xHxH values per row, or None when it is not square RGB."""
    size = schema.field("image").type.list_size
    side = math.isqrt(size // 3)
    return side if 3 * side * side == size else None


def _unreadable(path: Path, error: Exception) -> DataError:
    return DataError(f"parquet file '{path}' cannot be read ({one_line(error)}): it is corrupt or "
                     f"truncated. Fix: remove or re-export it.")


def _common_schema(files: list[Path]) -> pa.Schema:
    first = None
    for path in files:
        if not is_parquet(pafs.LocalFileSystem(), str(path)):
            raise DataError(f"'{path}' is not a parquet file (no PAR1 magic bytes). Fix: remove it from the input, "
                            f"or prepare it with --from text|jsonl|images.")
        try:
            schema = pq.read_schema(path).remove_metadata()
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(path, e) from None
        if first is None:
            first = (path, schema)
        elif not schema.equals(first[1]):
            diff = set(map(str, schema)) ^ set(map(str, first[1]))
            raise DataError(f"parquet files '{first[0]}' and '{path}' have different schemas (differing fields: "
                            f"{', '.join(sorted(diff))}). Fix: prepare them as separate datasets, or convert them "
                            f"to one schema.")
    return first[1]


def file_batches(path: Path, progress: Progress, columns=None) -> Iterator[pa.RecordBatch]:
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns):
            progress.update(nbytes=batch.nbytes)
            yield batch
    except (OSError, pa.ArrowException) as e:      # a footer that parses over pages that do not
        raise _unreadable(path, e) from None
    progress.update(files=1)


def parquet_passthrough(files: list[Path], progress: Progress, *, check_ids: bool = True) -> Iterator[pa.Table]:
    """Every column but `id` (raydl assigns its own stable ids); token ids and class labels are checked,
    unless the table is a generic one whose columns mean what its model says."""
    keep = [n for n in pq.read_schema(files[0]).names if n != "id"]
    for path in files:
        for batch in file_batches(path, progress, keep):
            if check_ids:
                _check_ids(path, batch)
            yield pa.Table.from_batches([batch])


def _check_ids(path: Path, batch: pa.RecordBatch) -> None:
    """Token ids and labels index embeddings and classes: a negative one (but the ignored label) would
    crash training or silently index from the end."""
    for name in ("input_ids", "labels", "label"):
        if name not in batch.schema.names:
            continue
        values = batch.column(name)
        values = pc.list_flatten(values) if pa.types.is_fixed_size_list(values.type) else values
        if name != "input_ids":
            values = pc.if_else(pc.equal(values, IGNORE_LABEL), 0, values)
        lowest = pc.min(values).as_py()
        if lowest is not None and lowest < 0:
            allowed = "" if name == "input_ids" else f" (or {IGNORE_LABEL}, a position without a label)"
            raise DataError(f"parquet '{path}' column {name} holds {lowest}, a negative id: ids must be >= 0"
                            f"{allowed}. Fix: correct the ids in that file (e.g. a tokenizer's unknown-token -1 "
                            f"mapped to a real token).")


def infer_meta(task: str, schema: pa.Schema, stats: dict) -> dict:
    """Model metadata of a passed-through parquet table, from its schema and the streamed maxima."""
    if task == "table":
        return {"task": "table", "columns": describe(schema.remove(schema.get_field_index("id")))}
    if task == "tokens":
        return {"task": "tokens", "vocab_size": int(stats["max_token"]) + 1,
                "seq_len": schema.field("input_ids").type.list_size}
    side = image_side(schema)
    return {"task": "images", "num_classes": int(stats["max_label"]) + 1, "image_shape": [3, side, side]}
