"""`raydl data prepare`: text, JSON lines, image folders or parquet -> a raydl dataset.

    raydl data prepare --from text   'corpus/*.txt'  --out data/corpus --seq-len 128
    raydl data prepare --from jsonl  'logs/*.jsonl'  --column text --out data/logs
    raydl data prepare --from images imagefolder/    --out data/imgs
    raydl data prepare --from parquet tables/        --out data/tables

Streaming with bounded memory: files are read in chunks (text, parquet batches, lines,
batches of images) and rows go to a `ShardWriter` that holds at most one shard, so a corpus
larger than RAM works; only the list of input file names is held whole.

- text/jsonl: tokens (`--tokenizer bytes|bpe|FILE.json`, raydl.data.tokenizer) with EOS after
  every document/record, packed into fixed rows of `seq_len` tokens; labels = the next token
  (row k covers tokens [k*T, k*T + T], so no token is lost between rows). A text file is read
  in pieces that end at a newline, so no word or UTF-8 character is split between pieces.
- images: one class per subfolder (sorted names), resized to 3x32x32 uint8 with Pillow; the
  file list is shuffled with a fixed seed first, so a class is not one long run of rows.
- parquet: columns kept; a tokens table (input_ids [+ labels] as fixed-size lists) or an
  images table (image + label); a string column given by --column is tokenized like text.

Every row gets a stable `id` (its index in the output stream; re-preparing the same inputs
gives the same ids); every `EVAL_EVERY`-th id goes to the held-out eval split. The output is
written to a temporary sibling directory and renamed at the end: all of it or nothing.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raydl.data import tokenizer as tokenizers
from raydl.data.dataset import ShardWriter, is_parquet, write_manifest
from raydl.errors import DataError

EVAL_EVERY = 16
IMAGE_SIZE = 32
CHUNK_BYTES = 1 << 20
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}
KINDS = ("text", "jsonl", "images", "parquet")


class Progress:
    """One self-overwriting stderr line, at most twice a second."""

    def __init__(self, total_files: int, enabled: bool = True):
        self.total, self.enabled = total_files, enabled
        self.files = self.rows = self.bytes = 0
        self.t0 = self.t_last = time.time()

    def update(self, *, files: int = 0, rows: int = 0, nbytes: int = 0, force: bool = False) -> None:
        self.files, self.rows, self.bytes = self.files + files, self.rows + rows, self.bytes + nbytes
        now = time.time()
        if self.enabled and (force or now - self.t_last > 0.5):
            self.t_last = now
            print(f"\r[raydl] prepare: {self.files}/{self.total} files, {self.rows:,} rows, "
                  f"{self.bytes / 1e6:.1f} MB read, {now - self.t0:.0f}s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.update(force=True)
        if self.enabled:
            print(file=sys.stderr, flush=True)


def list_sources(src: str, kind: str) -> list[Path]:
    """Input files, sorted; a glob, one file or a directory (searched recursively)."""
    if any(c in src for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(src, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"--from {kind} '{src}' matches no files. Fix: check the pattern (quote it so the "
                            f"shell does not expand it).")
        return files
    path = Path(src)
    if not path.exists():
        raise DataError(f"--from {kind} '{src}' does not exist. Fix: give an existing file, directory or glob.")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"--from {kind} '{src}' is an empty directory. Fix: put the input files in it or give "
                        f"another path.")
    return files


class Packer:
    """Byte tokens -> rows of (input_ids, labels) of `seq_len`; keeps only the unfinished tail."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.tail = np.empty(0, np.int32)

    def add(self, tokens: np.ndarray) -> pa.Table | None:
        buf = np.concatenate([self.tail, tokens.astype(np.int32)])
        n = (len(buf) - 1) // self.seq_len
        if n == 0:
            self.tail = buf
            return None
        rows = buf[np.arange(n)[:, None] * self.seq_len + np.arange(self.seq_len + 1)]
        self.tail = buf[n * self.seq_len:]       # its first token is the last row's final label
        return tokens_table(rows[:, :-1], rows[:, 1:])


def tokens_table(inputs: np.ndarray, labels: np.ndarray) -> pa.Table:
    t = inputs.shape[1]
    return pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(inputs.ravel()), t),
                     "labels": pa.FixedSizeListArray.from_arrays(pa.array(labels.ravel()), t)})


def text_pieces(kind: str, files: list[Path], column: str, progress: Progress) -> Iterator[tuple[bytes, bool]]:
    """(UTF-8 text, whether it ends a document) in input order, each piece about CHUNK_BYTES or less.
    A document is a text file, a JSON line's --column field, or a parquet row's --column value."""
    if kind == "text":
        for path in files:
            with open(path, "rb") as f:
                previous = b""
                for piece in _line_pieces(f):
                    progress.update(nbytes=len(piece))
                    if previous:
                        yield previous, False
                    previous = piece
                yield previous, True
            progress.update(files=1)
    elif kind == "jsonl":
        for path in files:
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    progress.update(nbytes=len(line))
                    if line.strip():
                        yield _record_text(path, lineno, line, column), True
            progress.update(files=1)
    else:
        for batch in _parquet_batches(files, progress, [column]):
            yield from ((value.encode("utf-8"), True) for value in batch.column(0).to_pylist() if value)


def _line_pieces(f) -> Iterator[bytes]:
    """A file's bytes in pieces ending at a newline (or at 8 chunks, for a file without newlines)."""
    rest = b""
    for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
        chunk = rest + chunk
        cut = chunk.rfind(b"\n") + 1 or (len(chunk) if len(chunk) >= 8 * CHUNK_BYTES else 0)
        rest = chunk[cut:]
        if cut:
            yield chunk[:cut]
    if rest:
        yield rest


def token_rows(pieces: Iterable[tuple[bytes, bool]], tokenizer, seq_len: int) -> Iterator[pa.Table]:
    """Tokenize pieces a CHUNK_BYTES batch at a time, EOS after each document, and pack into rows."""
    packer, batch, size = Packer(seq_len), [], 0
    eos = np.array([tokenizer.eos], np.int32)

    def packed() -> pa.Table | None:
        ids = tokenizer.encode([text for text, _ in batch])
        tokens = [t for one, (_, ends) in zip(ids, batch) for t in ((one, eos) if ends else (one,))]
        return packer.add(np.concatenate(tokens)) if tokens else None

    for text, ends in pieces:
        batch.append((text, ends))
        size += len(text)
        if size >= CHUNK_BYTES:
            if (table := packed()) is not None:
                yield table
            batch, size = [], 0
    if batch and (table := packed()) is not None:
        yield table


def _record_text(path: Path, lineno: int, line: bytes, column: str) -> bytes:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"'{path}' line {lineno} is not valid JSON ({e}). Fix: repair or remove that line.") from None
    value = record.get(column) if isinstance(record, dict) else None
    if not isinstance(value, str):
        have = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"'{path}' line {lineno} has no string field '{column}' (it has: {have}). Fix: pass "
                        f"--column NAME with the field that holds the text.")
    return value.encode("utf-8")


def image_rows(files: list[Path], root: Path, progress: Progress) -> tuple[Iterator[pa.Table], list[str]]:
    labelled = [(p, p.relative_to(root).parts[0]) for p in files
                if p.suffix.lower() in IMAGE_EXTS and len(p.relative_to(root).parts) == 2]
    classes = sorted({c for _, c in labelled})
    if not classes:
        raise DataError(f"--from images '{root}' has no images in class subfolders (expected "
                        f"{root}/<class>/<image>.png|jpg). Fix: put each class's images in its own subfolder.")
    order = np.random.default_rng(0).permutation(len(labelled))
    index = {c: i for i, c in enumerate(classes)}

    def batches() -> Iterator[pa.Table]:
        for start in range(0, len(order), 256):
            chosen = [labelled[i] for i in order[start:start + 256]]
            images = np.stack([_load_image(p) for p, _ in chosen]).reshape(len(chosen), -1)
            progress.update(files=len(chosen), nbytes=sum(p.stat().st_size for p, _ in chosen))
            yield pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(images.ravel()), images.shape[1]),
                            "label": pa.array([index[c] for _, c in chosen], pa.int64())})

    return batches(), classes


def _load_image(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
            return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    except (OSError, UnidentifiedImageError) as e:
        raise DataError(f"image '{path}' cannot be read ({e}). Fix: remove or replace that file.") from None


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


def _parquet_batches(files: list[Path], progress: Progress, columns=None) -> Iterator[pa.RecordBatch]:
    for path in files:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=columns):
            progress.update(nbytes=batch.nbytes)
            yield batch
        progress.update(files=1)


def _parquet_passthrough(files: list[Path], progress: Progress) -> Iterator[pa.Table]:
    keep = [n for n in pq.read_schema(files[0]).names if n != "id"]     # raydl assigns its own stable ids
    for batch in _parquet_batches(files, progress, keep):
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


def prepare(kind: str, src: str, out: str, *, shard_rows: int = 2048, column: str = "text", seq_len: int = 128,
            tokenizer: str = "bytes", vocab_size: int = 8192, progress: bool = True) -> dict:
    """Write the dataset; returns its manifest."""
    if kind not in KINDS:
        raise DataError(f"--from {kind!r} is not one of {', '.join(KINDS)}. Fix: pick one of them.")
    if shard_rows <= 0 or seq_len <= 0:
        raise DataError(f"--shard-rows {shard_rows} and --seq-len {seq_len} must be positive. Fix: use values > 0.")
    target = Path(out)
    if target.exists() and any(target.iterdir()):
        raise DataError(f"--out '{out}' already exists and is not empty. Fix: choose a new directory (raydl never "
                        f"writes over a dataset) or delete it.")
    files = list_sources(src, kind)
    bar = Progress(len(files), enabled=progress)
    task = parquet_task(files, column) if kind == "parquet" else {"images": "images"}.get(kind, "text")
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        if task == "text":
            training = (text for text, _ in text_pieces(kind, files, column, Progress(len(files), enabled=False)))
            tok = tokenizers.load(tokenizer, vocab_size=vocab_size, training_texts=training)
            rows, meta = token_rows(text_pieces(kind, files, column, bar), tok, seq_len), {
                "task": "tokens", "seq_len": seq_len, **tok.save(tmp)}
        elif kind == "images":
            rows, classes = image_rows(files, Path(src), bar)
            meta = {"task": "images", "num_classes": len(classes), "image_shape": [3, IMAGE_SIZE, IMAGE_SIZE],
                    "classes": classes}
        else:
            rows, meta = _parquet_passthrough(files, bar), {}
        splits, stats = write_rows(tmp, rows, shard_rows, bar)
        if not meta:
            meta = infer_meta(task, pq.read_schema(tmp / splits["train"][0]["file"]), stats)
        meta["source"] = {"from": kind, "src": src, "files": len(files), "eval_every": EVAL_EVERY}
        write_manifest(tmp, meta, splits)
        if target.exists():
            target.rmdir()
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        bar.close()
    return json.loads((target / "manifest.json").read_text())


def write_rows(root: Path, rows: Iterable[pa.Table], shard_rows: int, bar: Progress) -> tuple[dict, dict]:
    """Number the rows, route every EVAL_EVERY-th to eval, write both splits; also streams maxima for metadata."""
    writers = {s: ShardWriter(root, s, shard_rows=shard_rows) for s in ("train", "eval")}
    next_id, stats = 0, {"max_token": 0, "max_label": 0}
    for table in rows:
        ids = np.arange(next_id, next_id + table.num_rows, dtype=np.int64)
        next_id += table.num_rows
        _update_stats(stats, table)
        table = table.add_column(0, "id", pa.array(ids))
        is_eval = ids % EVAL_EVERY == 0
        writers["eval"].add(table.filter(pa.array(is_eval)))
        writers["train"].add(table.filter(pa.array(~is_eval)))
        bar.update(rows=table.num_rows)
    splits = {s: w.close() for s, w in writers.items()}
    if not splits["train"]:
        raise DataError(f"the input gave {next_id} rows, too few for a train split (every {EVAL_EVERY}th row goes "
                        f"to eval; text needs more than seq_len tokens per row). Fix: add data or lower --seq-len.")
    return splits, stats


def _update_stats(stats: dict, table: pa.Table) -> None:
    if "input_ids" in table.column_names:
        stats["max_token"] = max(stats["max_token"], pc.max(pc.list_flatten(table["input_ids"])).as_py() or 0)
    if "label" in table.column_names:
        stats["max_label"] = max(stats["max_label"], pc.max(table["label"]).as_py() or 0)
