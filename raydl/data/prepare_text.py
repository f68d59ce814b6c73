"""Text, JSON lines and parquet text columns -> packed token rows, for `raydl data prepare`.

Tokens (`--tokenizer bytes|bpe|FILE.json`, raydl.data.tokenizer) with EOS after every
document/record, packed into fixed rows of `seq_len` tokens; labels = the next token (row k
covers tokens [k*T, k*T + T], so no token is lost between rows). A text file is read in
pieces that end at a newline, so no word or UTF-8 character is split between pieces.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from raydl.data.input_files import Progress
from raydl.data.prepare_parquet import file_batches
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
    pieces = {"text": _text_file_pieces, "jsonl": _jsonl_pieces, "parquet": _parquet_pieces}[kind]
    for path in files:
        yield from pieces(path, column, progress)


def _text_file_pieces(path: Path, column: str, progress: Progress) -> Iterator[tuple[bytes, bool]]:
    utf8, offset, previous = codecs.getincrementaldecoder("utf-8")(), 0, b""
    with open(path, "rb") as f:
        for piece in _line_pieces(f):
            _check_utf8(path, utf8, piece, offset)
            offset += len(piece)
            progress.update(nbytes=len(piece))
            if previous:
                yield previous, False
            previous = piece
    _check_utf8(path, utf8, b"", offset, final=True)
    yield previous, True
    progress.update(files=1)


def _check_utf8(path: Path, utf8: codecs.IncrementalDecoder, piece: bytes, offset: int, final: bool = False) -> None:
    """Decode to check, with the decoder carrying a character cut between pieces: the byte tokenizer
    would take anything, but the dataset promises UTF-8 (BPE and `raydl data inspect` decode it)."""
    pending = len(utf8.getstate()[0])
    try:
        utf8.decode(piece, final)
    except UnicodeDecodeError as e:
        raise DataError(f"'{path}' is not UTF-8 text: byte {offset - pending + e.start} is {e.reason} "
                        f"({e.object[e.start:e.start + 3]!r}: a lone surrogate, or another encoding such as Latin-1 "
                        f"or UTF-16). Fix: convert the file to UTF-8 (e.g. `iconv -f LATIN1 -t UTF-8`), or remove "
                        f"it from the input.") from None


def _jsonl_pieces(path: Path, column: str, progress: Progress) -> Iterator[tuple[bytes, bool]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            progress.update(nbytes=len(line))
            if line.strip():
                yield _record_text(path, lineno, line, column), True
    progress.update(files=1)


def _parquet_pieces(path: Path, column: str, progress: Progress) -> Iterator[tuple[bytes, bool]]:
    for batch in file_batches(path, progress, [column]):
        try:
            values = batch.column(0).to_pylist()
        except UnicodeDecodeError as e:     # Arrow does not validate the UTF-8 of a string column it reads
            raise DataError(f"parquet '{path}' column {column} holds text that is not UTF-8 ({e.reason}). Fix: "
                            f"re-export the file with valid UTF-8 strings.") from None
        yield from ((value.encode("utf-8"), True) for value in values if value)


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
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as e:      # a JSON escape such as "\ud800" decodes to half a character
        raise DataError(f"'{path}' line {lineno} field '{column}' holds a lone surrogate ({e.object[e.start]!r}), "
                        f"half of a UTF-16 pair, which is not text. Fix: repair or remove that line (its writer "
                        f"split a character).") from None
