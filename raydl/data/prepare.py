"""`raydl data prepare`: text, JSON lines, image folders or parquet -> a raydl dataset.

    raydl data prepare --from text   'corpus/*.txt'  --out data/corpus --seq-len 128
    raydl data prepare --from jsonl  'logs/*.jsonl'  --column text --out data/logs
    raydl data prepare --from images imagefolder/    --out data/imgs
    raydl data prepare --from parquet tables/        --out data/tables
    raydl data prepare --from parquet measurements/  --out data/m --keep-columns

Streaming with bounded memory: files are read in chunks (text, parquet batches, lines,
batches of images) and rows go to a `ShardWriter` that holds at most one shard, so a corpus
larger than RAM works; only the list of input file names is held whole. Each kind of input
has its module: raydl.data.prepare_text (text, jsonl, a parquet text column),
raydl.data.prepare_images, raydl.data.prepare_parquet (tables passed through).

Every row gets a stable `id` (its index in the output stream; re-preparing the same inputs
gives the same ids); every `EVAL_EVERY`-th id goes to the held-out eval split. --out is a path or a
URI (s3://, gs://, ...: raydl.storage). The dataset appears all of it or nothing: locally it is written
to a hidden sibling directory renamed at the end; on an object store the shards go straight to --out
and manifest.json, without which it is no dataset, last.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from raydl import storage
from raydl.data import tokenizer as tokenizers
from raydl.data.columns import is_variable_list
from raydl.data.dataset import ShardWriter, publish, read_footer, staging_dir, write_manifest
from raydl.data.input_files import Progress, list_sources, source_root
from raydl.data.prepare_images import IMAGE_SIZE, image_rows
from raydl.data.prepare_parquet import infer_meta, parquet_passthrough, parquet_task
from raydl.data.prepare_records import Counts, RecordEncoder, RecordFormat, record_rows
from raydl.data.prepare_text import text_pieces, token_rows
from raydl.errors import DataError

EVAL_EVERY = 16
KINDS = ("text", "jsonl", "images", "parquet")


def prepare(kind: str, src: str, out: str, *, shard_rows: int = 2048, column: str = "text", seq_len: int = 128,
            tokenizer: str = "bytes", vocab_size: int = 8192, keep_columns: bool = False,
            records: RecordFormat | None = None, progress: bool = True) -> dict:
    """Write the dataset; returns its manifest. `keep_columns`: a parquet input is a generic table, every
    column kept (what any table that is not tokens, images or text becomes anyway). `records`: jsonl records,
    one row each with its loss mask (raydl.data.prepare_records), tokenized by the directory `tokenizer`."""
    if records is not None:
        return prepare_records(src, out, records, tokenizer, shard_rows=shard_rows, progress=progress)
    if kind not in KINDS:
        raise DataError(f"--from {kind!r} is not one of {', '.join(KINDS)}. Fix: pick one of them.")
    if shard_rows <= 0 or seq_len <= 0:
        raise DataError(f"--shard-rows {shard_rows} and --seq-len {seq_len} must be positive. Fix: use values > 0.")
    fs, target = storage.check(out, "--out")
    _check_out(out, fs, target)
    files = list_sources(src, kind)
    bar = Progress(len(files), enabled=progress)
    task = parquet_task(files, column, keep_columns=keep_columns) if kind == "parquet" else {"images": "images"}.get(kind, "text")
    tmp = staging_dir(fs, target)
    try:
        with writing(out):
            fs.create_dir(tmp)
        if task == "text":
            training = (text for text, _ in text_pieces(kind, files, column, Progress(len(files), enabled=False)))
            tok = tokenizers.load(tokenizer, vocab_size=vocab_size, training_texts=training)
            with writing(out):
                saved = tok.save(fs, tmp)
            rows, meta = token_rows(text_pieces(kind, files, column, bar), tok, seq_len), {
                "task": "tokens", "seq_len": seq_len, **saved}
        elif kind == "images":
            rows, classes = image_rows(files, source_root(src), bar)
            meta = {"task": "images", "num_classes": len(classes), "image_shape": [3, IMAGE_SIZE, IMAGE_SIZE],
                    "classes": classes}
        else:
            rows, meta = parquet_passthrough(files, bar, check_ids=task != "table"), {}
        splits, stats = write_rows(fs, tmp, rows, shard_rows, bar, out=out)
        if not meta:
            schema = read_footer(fs, f"{tmp}/{splits['train'][0]['file']}").schema.to_arrow_schema()
            meta = infer_meta(task, schema, stats)
        meta["source"] = {"from": kind, "src": src, "files": len(files), "eval_every": EVAL_EVERY}
        with writing(out):
            write_manifest(fs, tmp, meta, splits)
            publish(tmp, target)
    except BaseException:   # a SIGKILL leaves shards without a manifest, which is no dataset
        storage.remove_dir(fs, tmp)
        raise
    finally:
        bar.close()
    return json.loads(storage.read_bytes(fs, f"{target}/manifest.json"))


def prepare_records(src: str, out: str, fmt: RecordFormat, tokenizer_dir: str, *, shard_rows: int,
                    progress: bool) -> dict:
    """`prepare` for --format: one row per jsonl record; the tokenizer directory is checked (and the chat template
    found) before anything is written, and kept in the dataset for `raydl generate`."""
    from raydl.data.hf_tokenizer import KEPT, load_tokenizer_dir

    if shard_rows <= 0 or fmt.seq_len <= 0:
        raise DataError(f"--shard-rows {shard_rows} and --seq-len {fmt.seq_len} must be positive. Fix: use values > 0.")
    tok = load_tokenizer_dir(tokenizer_dir)
    encoder = RecordEncoder(tok, fmt, tokenizer_dir)
    fs, target = storage.check(out, "--out")
    _check_out(out, fs, target)
    files = list_sources(src, "jsonl")
    bar, counts = Progress(len(files), enabled=progress), Counts()
    tmp = staging_dir(fs, target)
    try:
        with writing(out):
            fs.create_dir(f"{tmp}/tokenizer", recursive=True)
            for name in KEPT:
                if (Path(tokenizer_dir) / name).is_file():
                    storage.write_bytes(fs, f"{tmp}/tokenizer/{name}", (Path(tokenizer_dir) / name).read_bytes())
        splits, _ = write_rows(fs, tmp, record_rows(files, encoder, fmt, counts, bar), shard_rows, bar, out=out)
        meta = {"task": "tokens", "seq_len": fmt.seq_len, "vocab_size": len(tok), "eos": tok.eos_token_id,
                "tokenizer": "hf", "tokenizer_dir": "tokenizer",
                "records": {"format": fmt.format, "train_on": fmt.train_on if fmt.format == "chat" else None,
                            "chat_template": fmt.format == "chat", "overflow": fmt.overflow, "packed": fmt.pack,
                            **counts.summary(fmt.seq_len)},
                "source": {"from": "jsonl", "src": src, "files": len(files), "eval_every": EVAL_EVERY}}
        with writing(out):
            write_manifest(fs, tmp, meta, splits)
            publish(tmp, target)
    except BaseException:
        storage.remove_dir(fs, tmp)
        raise
    finally:
        bar.close()
    return json.loads(storage.read_bytes(fs, f"{target}/manifest.json"))


def _check_out(out: str, fs: pafs.FileSystem, target: str) -> None:
    if fs.get_file_info(target).type == pafs.FileType.File:
        raise DataError(f"--out '{out}' is an existing file, not a directory. Fix: give a new directory path for "
                        f"the dataset (raydl never writes over a file).")
    if not storage.is_empty_or_missing(fs, target):
        raise DataError(f"--out '{out}' already exists and is not empty (on an object store: perhaps the shards of "
                        f"a prepare that was interrupted, which left no manifest.json). Fix: choose a new directory "
                        f"(raydl never writes over a dataset) or delete it.")


@contextlib.contextmanager
def writing(out: str) -> Iterator[None]:
    """An OSError while writing the dataset (a full or read-only disk, a failed upload) as one DataError naming
    --out. What was written is removed on the way out (`prepare`), so a failure leaves nothing there."""
    try:
        yield
    except OSError as e:
        raise DataError(f"cannot write the dataset to '{out}': {e.strerror or e}. Fix: free space on that disk, "
                        f"or choose a writable --out; nothing was left there (the partial copy was "
                        f"removed).") from None


def write_rows(fs: pafs.FileSystem, root: str, rows: Iterable[pa.Table], shard_rows: int, bar: Progress, *,
               out: str) -> tuple[dict, dict]:
    """Number the rows, route every EVAL_EVERY-th to eval, write both splits; also streams maxima for metadata."""
    writers = {s: ShardWriter(fs, root, s, shard_rows=shard_rows) for s in ("train", "eval")}
    next_id, stats = 0, {"max_token": 0, "max_label": 0}
    for table in rows:
        ids = np.arange(next_id, next_id + table.num_rows, dtype=np.int64)
        next_id += table.num_rows
        _update_stats(stats, table)
        table = table.add_column(0, "id", pa.array(ids))
        is_eval = ids % EVAL_EVERY == 0
        with writing(out):
            writers["eval"].add(table.filter(pa.array(is_eval)))
            writers["train"].add(table.filter(pa.array(~is_eval)))
        bar.update(rows=table.num_rows)
    with writing(out):
        splits = {s: w.close() for s, w in writers.items()}
    if not splits["train"]:
        raise DataError(f"the input gave {next_id} rows, too few for a train split (every {EVAL_EVERY}th row goes "
                        f"to eval; text needs more than seq_len tokens per row). Fix: add data or lower --seq-len.")
    return splits, stats


def _update_stats(stats: dict, table: pa.Table) -> None:
    """Maxima of the integer token ids and class labels, for a tokens or images table's metadata (a
    generic table's columns of those names may hold anything, strings included)."""
    for name, key in (("input_ids", "max_token"), ("label", "max_label")):
        if name not in table.column_names:
            continue
        values = table[name]
        if pa.types.is_fixed_size_list(values.type) or is_variable_list(values.type):
            values = pc.list_flatten(values)
        if pa.types.is_integer(values.type):
            stats[key] = max(stats[key], pc.max(values).as_py() or 0)
