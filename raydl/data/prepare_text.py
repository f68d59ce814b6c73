"""Text, JSON lines and parquet text columns -> packed token rows, for `raydl data prepare`.

Tokens (`--tokenizer bytes|bpe|FILE.json`, raydl.data.tokenizer) with EOS after every
document/record, packed into fixed rows of `seq_len` tokens; labels = the next token (row k
covers tokens [k*T, k*T + T], so no token is lost between rows). A text file is read in
pieces that end at a newline, so no word or UTF-8 character is split between pieces.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from raydl.data.input_files import Progress
from raydl.data.prepare_parquet import parquet_batches
from raydl.errors import DataError

CHUNK_BYTES = 1 << 20


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
        for batch in parquet_batches(files, progress, [column]):
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
