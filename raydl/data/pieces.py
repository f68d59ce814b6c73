"""A step's rows as pieces of decoded tables, copied once into the step's arrays.

Both readers hand a step over as `Piece`s: a decoded table (a row group, or a range a Ray Data read
task sent) and the rows taken from it, in order: a slice, or indices in the row group's shuffled
order. `gather` copies a column's rows of all the pieces into one array, from numpy views of the
decoded buffers that each table makes once. Shuffling every row group into a copy first and then
concatenating a step's slices of it as Arrow tables had cost a second copy and, per piece and
column, the Python calls around it (raydl bench ingest's epoch: 0.15 -> 0.10 s of work besides the
decoding, which takes 0.33 s).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


class Decoded:
    """A decoded table and, made on first use, numpy views (no copy) of its fixed-shape columns."""

    def __init__(self, table: pa.Table):
        self.table = table
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str) -> np.ndarray:
        """Column `name` as (rows,) or, for a fixed-size list, (rows, list size)."""
        if name not in self._arrays:
            self._arrays[name] = _numpy(self.table.column(name))
        return self._arrays[name]


def _numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        size = column.type.list_size
        # The values sliced directly: `flatten` went through Arrow's compute layer.
        values = column.values.slice(column.offset * size, len(column) * size)
        return values.to_numpy(zero_copy_only=False).reshape(len(column), size)
    return column.to_numpy(zero_copy_only=False)


@dataclass(frozen=True)
class Piece:
    """The rows `rows` (a slice, or indices) of a decoded table, in that order."""
    source: Decoded
    rows: slice | np.ndarray

    @classmethod
    def whole(cls, table: pa.Table) -> Piece:
        return cls(Decoded(table), slice(0, table.num_rows))

    def __len__(self) -> int:
        if isinstance(self.rows, slice):
            return self.rows.stop - self.rows.start
        return len(self.rows)

    def arrow(self) -> pa.Table:
        if isinstance(self.rows, slice):
            return self.source.table.slice(self.rows.start, len(self))
        return take_rows(self.source.table, self.rows)


def gather(pieces: list[Piece], name: str) -> np.ndarray:
    """Column `name` (fixed shape) of the pieces' rows, in one new array (writable: torch takes it as is).

    Each piece's rows are copied straight into their place: indexing each piece into an array of its own and
    concatenating those copied every row twice (raydl bench ingest)."""
    sources = [piece.source.array(name) for piece in pieces]
    out = np.empty((sum(map(len, pieces)), *sources[0].shape[1:]), sources[0].dtype)
    at = 0
    for piece, source in zip(pieces, sources):
        rows = out[at:at + len(piece)]
        if isinstance(piece.rows, slice):
            rows[...] = source[piece.rows]
        else:
            np.take(source, piece.rows, axis=0, out=rows)
        at += len(piece)
    return out


def concat(pieces: list[Piece]) -> pa.Table:
    """The pieces' rows as one Arrow table (for preprocessing and variable-length columns)."""
    return pa.concat_tables([piece.arrow() for piece in pieces])


def take_rows(table: pa.Table, indices: np.ndarray) -> pa.Table:
    """`table.take(indices)`, gathering with numpy: Arrow's take on fixed-size-list columns was 3x
    slower (raydl bench ingest, 512-token rows)."""
    columns = []
    for col in table.columns:
        col = col.combine_chunks()
        if pa.types.is_fixed_size_list(col.type) and col.null_count == 0 and col.type.value_type.bit_width % 8 == 0:
            values = _numpy(col)[indices]
            columns.append(pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), col.type.list_size))
        else:
            columns.append(col.take(pa.array(indices)))
    return pa.Table.from_arrays(columns, schema=table.schema)
