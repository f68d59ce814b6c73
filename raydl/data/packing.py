"""Records packed into rows of --seq-len tokens (`raydl data prepare --pack`), best-fit decreasing.

    rows = pack_lengths([300, 1800, 40, 250], capacity=2048)     # [[1], [0, 3, 2]]: record indices per row

Best-fit decreasing (TRL's packer; axolotl's multipack is first-fit decreasing): the records longest first, each
into the row it leaves the least room in, or a new row. On log-normal lengths (median 200, sigma 1) at 2048 it fills
over 98% of the slots (tests/unit/test_packing.py). Each packed row carries `document_ids` (0, 1, 2... per record
in the row), from which the models derive positions that restart per record and a block-diagonal causal mask
(raydl.models.packing); every record keeps its own (input, label) pairs, so no label predicts across a boundary.
Records arrive as a stream: they are packed PACK_WINDOW at a time, which bounds memory (a window's last rows are
the only ones left partly empty).
"""

from __future__ import annotations

import bisect
from typing import Iterator, Sequence

import pyarrow as pa

from raydl.data.columns import DOCUMENTS

PACK_WINDOW = 16384   # records packed together


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` per row (each row's total <= capacity), best-fit decreasing; deterministic. A row
    holds its records longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []     # (free slots, row), sorted: the tightest fit is the first >= length
    for i in order:
        length = lengths[i]
        if length > capacity:
            raise ValueError(f"record {i} has {length} tokens, more than a row's {capacity}")
        at = bisect.bisect_left(room, (length, -1))
        if at == len(room):
            rows.append([i])
            free, row = capacity - length, len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(i)
            free -= length
        if free:
            bisect.insort(room, (free, row))
    return rows


def packed_tables(records: Iterator[tuple[list[int], list[int]]], capacity: int, *,
                  window: int = PACK_WINDOW) -> Iterator[pa.Table]:
    """(input_ids, labels) records -> tables of packed rows with their `document_ids`, one table per window."""
    batch: list[tuple[list[int], list[int]]] = []
    for record in records:
        batch.append(record)
        if len(batch) >= window:
            yield _packed_table(batch, capacity)
            batch = []
    if batch:
        yield _packed_table(batch, capacity)


def _packed_table(records: list[tuple[list[int], list[int]]], capacity: int) -> pa.Table:
    inputs, labels, documents = [], [], []
    for row in pack_lengths([len(ids) for ids, _ in records], capacity):
        inputs.append([t for i in row for t in records[i][0]])
        labels.append([t for i in row for t in records[i][1]])
        documents.append([d for d, i in enumerate(row) for _ in records[i][0]])
    kind = pa.list_(pa.int32())
    return pa.table({"input_ids": pa.array(inputs, kind), "labels": pa.array(labels, kind),
                     DOCUMENTS: pa.array(documents, kind)})
