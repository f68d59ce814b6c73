"""Worker-side loader: this rank's rows of each global step, read ahead on a thread.

The rows come from `SplitReader` (pyarrow in this process, data.backend=arrow) or from Ray
Data read tasks (raydl.data.ray_source, data.backend=ray); both follow raydl.data.order.
The loader yields `StepBatch`es carrying the data position *after* the step, which is what
a checkpoint records. The time a step waits in `next()` is the data-wait metric.

A shard that cannot be read fails the run with a DataError naming it (the last checkpoint
stays valid), unless `data.max_bad_shards` allows skipping it: then its rows keep their
places in the epoch sequence as masked placeholders (id -1, labels -100, which the losses
ignore), so batch shapes and every other row's position stay the same on every rank and
after any restart: the remaining rows are still consumed exactly once.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raydl.data.dataset import DatasetInfo, schema_dict
from raydl.data.ledger import Ledger
from raydl.data.order import DataPosition, EpochOrder, RowGroup, rank_slice, steps_per_epoch
from raydl.data.preprocess import make_preprocess
from raydl.errors import DataError

OPEN_SHARDS = 64


@dataclass
class StepBatch:
    tensors: dict[str, torch.Tensor]   # this rank's rows: column -> (rows, ...) tensor
    position: DataPosition             # where the sequence stands after this step
    wait_s: float = 0.0
    bad_shards: int = 0                # shards this rank has skipped so far (data.max_bad_shards)


def to_tensors(table: pa.Table, meta: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            arr = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
        else:
            arr = col.to_numpy(zero_copy_only=False)
        out[name] = torch.from_numpy(np.array(arr, copy=not arr.flags.writeable, order="C"))
    if "image" in out:
        out["image"] = out["image"].view(-1, *meta["image_shape"])
    return out


def take_rows(table: pa.Table, indices: np.ndarray) -> pa.Table:
    """`table.take(indices)`, gathering with numpy: Arrow's take on fixed-size-list columns was 3x
    slower (raydl bench ingest, 512-token rows), and every window is gathered once per epoch."""
    columns = []
    for col in table.columns:
        col = col.combine_chunks()
        if pa.types.is_fixed_size_list(col.type) and col.null_count == 0 and col.type.value_type.bit_width % 8 == 0:
            values = col.flatten().to_numpy().reshape(len(col), col.type.list_size)[indices]
            columns.append(pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), col.type.list_size))
        else:
            columns.append(col.take(pa.array(indices)))
    return pa.Table.from_arrays(columns, schema=table.schema)


_PREFETCHERS: list[tuple[threading.Event, threading.Thread]] = []


@atexit.register
def _stop_prefetchers() -> None:
    """A prefetch thread still inside pyarrow at interpreter exit aborts the process
    ("terminate called without an active exception"): stop and join them first."""
    for stop, thread in _PREFETCHERS:
        stop.set()
    for _, thread in _PREFETCHERS:
        thread.join(timeout=10)


IGNORE_LABEL = -100   # the losses' ignore_index: placeholder rows add nothing to loss or gradient


class SplitReader:
    """Random access to a split's rows in one epoch's order, one window in memory at a time."""

    def __init__(self, info: DatasetInfo, split: str, *, seed: int, shuffle: bool, max_bad_shards: int = 0):
        self.info, self.split, self.seed, self.shuffle = info, split, seed, shuffle
        self.shards = info.splits[split]
        self.row_groups = tuple(RowGroup(s, i, n) for s, shard in enumerate(self.shards)
                                for i, n in enumerate(shard.row_groups))
        self.fs, self.root = info.filesystem()
        self.max_bad_shards = max_bad_shards
        self.bad_shards: set[str] = set()
        self.schema: pa.Schema | None = None      # of the first shard read; every other must match
        self._cache: tuple[tuple[int, int], pa.Table] | None = None
        self._order: EpochOrder | None = None
        # Shards kept open: a shuffled window hops between shards, and reopening re-parses the footer.
        self._files: collections.OrderedDict[str, pq.ParquetFile] = collections.OrderedDict()

    def order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order.epoch != epoch:     # keep its cached permutations
            self._order = EpochOrder(self.row_groups, self.seed, epoch, self.shuffle)
        return self._order

    def _read_row_group(self, g: RowGroup) -> pa.Table:
        path = f"{self.root.rstrip('/')}/{self.shards[g.shard].file}"
        if path in self.bad_shards:
            return self._placeholder(g.rows)
        try:
            return self._open(path).read_row_group(g.index, use_threads=False)
        except (OSError, pa.ArrowException) as e:
            return self._skip(path, g, e)

    def _open(self, path: str) -> pq.ParquetFile:
        if path in self._files:
            self._files.move_to_end(path)
        else:
            self._files[path] = pq.ParquetFile(self.fs.open_input_file(path))
            self._check_schema(path, self._files[path].schema_arrow)
            if len(self._files) > OPEN_SHARDS:
                self._files.popitem(last=False)
        return self._files[path]

    def _check_schema(self, path: str, schema: pa.Schema) -> None:
        expected = self.info.meta["schema"]
        if schema_dict(schema) != expected:
            diff = sorted(set(schema_dict(schema).items()) ^ set(expected.items()))
            raise DataError(f"shard '{path}' has a different schema from the one in '{self.root}/manifest.json' "
                            f"(differing fields: {', '.join(f'{k}: {v}' for k, v in diff)}). Fix: re-create the "
                            f"dataset with `raydl data prepare`, which writes one schema for all shards.")
        self.schema = self.schema or schema.remove_metadata()

    def _skip(self, path: str, g: RowGroup, error: Exception) -> pa.Table:
        if len(self.bad_shards) >= self.max_bad_shards:
            raise DataError(f"shard '{path}' (row group {g.index}) cannot be read: {error}. Skipped so far: "
                            f"{len(self.bad_shards)}, data.max_bad_shards={self.max_bad_shards}. Fix: re-create the "
                            f"dataset with `raydl data prepare`, or raise data.max_bad_shards to skip bad shards "
                            f"(their rows are left out).")
        print(f"[raydl] skipping unreadable shard '{path}' ({len(self.bad_shards) + 1}/{self.max_bad_shards} "
              f"allowed by data.max_bad_shards): {error}", flush=True)
        self.bad_shards.add(path)
        return self._placeholder(g.rows)

    def _placeholder(self, rows: int) -> pa.Table:
        if self.schema is None:    # nothing read yet: take the schema from any readable shard's footer
            self.schema = self._any_schema()
        columns = {}
        for field in self.schema:
            fill = -1 if field.name == "id" else IGNORE_LABEL if field.name in ("label", "labels") else 0
            if pa.types.is_fixed_size_list(field.type):
                n = field.type.list_size
                values = pa.array(np.full(rows * n, fill), field.type.value_type)
                columns[field.name] = pa.FixedSizeListArray.from_arrays(values, n)
            else:
                columns[field.name] = pa.array(np.full(rows, fill), field.type)
        return pa.table(columns, schema=self.schema)

    def _any_schema(self) -> pa.Schema:
        for shard in self.shards:
            path = f"{self.root.rstrip('/')}/{shard.file}"
            try:
                with self.fs.open_input_file(path) as f:
                    return pq.read_schema(f).remove_metadata()
            except (OSError, pa.ArrowException):
                self.bad_shards.add(path)
        raise DataError(f"no shard of the {self.split} split of '{self.root}' can be read. Fix: re-create the "
                        f"dataset with `raydl data prepare`.")

    def window_rows(self, order: EpochOrder, window: int) -> pa.Table:
        """The rows of `window`, its row groups concatenated (not yet shuffled)."""
        return pa.concat_tables([self._read_row_group(order.row_groups[g]) for g in order.windows[window]])

    def _window(self, order: EpochOrder, window: int) -> pa.Table:
        key = (order.epoch, window)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, take_rows(self.window_rows(order, window), order.row_permutation(window)))
        return self._cache[1]

    def rows(self, order: EpochOrder, start: int, end: int) -> pa.Table:
        """Rows [start, end) of the epoch sequence."""
        parts = []
        while start < end:
            window, offset = order.locate(start)
            table = self._window(order, window)
            take = min(end - start, table.num_rows - offset)
            parts.append(table.slice(offset, take))
            start += take
        return pa.concat_tables(parts)


class StepLoader:
    """Yields this rank's slice of every global step from `position` on, for `max_epochs` (0 = forever).

    data.backend picks who reads: `arrow` reads the windows with pyarrow in this process
    (SplitReader); `ray` streams the same rows, in the same order, through Ray Data read tasks
    on the cluster's CPUs (raydl.data.ray_source).
    """

    def __init__(self, info: DatasetInfo, *, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 shuffle: bool, position: DataPosition, prefetch: int = 2, split: str = "train",
                 max_bad_shards: int = 0, backend: str = "arrow", augment: bool = False, read_cpus: float = 1.0):
        self.info, self.split, self.seed, self.shuffle = info, split, seed, shuffle
        self.reader = SplitReader(info, split, seed=seed, shuffle=shuffle, max_bad_shards=max_bad_shards)
        self.meta = info.meta
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.position = position
        self.prefetch = prefetch
        self.backend, self.augment, self.read_cpus = backend, augment, read_cpus
        self.steps_per_epoch = steps_per_epoch(self.reader.order(0).num_rows, global_batch)
        if self.steps_per_epoch == 0:
            raise DataError(f"the {split} split has {self.reader.order(0).num_rows} rows, fewer than one global batch "
                            f"({global_batch}). Fix: lower train.global_batch_size or add data.")
        self.ledger = Ledger(dp_rank=dp_rank, dp_size=dp_size, start=position, steps_per_epoch=self.steps_per_epoch,
                             global_batch=global_batch)

    def _produce(self) -> Iterator[StepBatch]:
        epoch, offset = self.position.epoch, self.position.offset
        for table_epoch, table in self._tables():
            if table_epoch != epoch:      # drop_last: a final partial global batch is skipped by every rank
                epoch, offset = table_epoch, 0
            offset += self.global_batch
            yield StepBatch(to_tensors(table, self.meta), DataPosition(epoch, offset),
                            bad_shards=len(self.reader.bad_shards))

    def _tables(self) -> Iterator[tuple[int, pa.Table]]:
        """(epoch, this rank's preprocessed rows) of every step from `position` on."""
        if self.backend == "ray":
            from raydl.data.ray_source import stream

            yield from stream(self.info, self.split, start=self.position, seed=self.seed, shuffle=self.shuffle,
                              global_batch=self.global_batch, dp_rank=self.dp_rank, dp_size=self.dp_size,
                              augment=self.augment, prefetch=self.prefetch, read_cpus=self.read_cpus)
            return
        epoch, offset = self.position.epoch, self.position.offset
        preprocess = make_preprocess(self.meta, augment=self.augment, seed=self.seed)
        while True:
            order = self.reader.order(epoch)
            while offset + self.global_batch <= order.num_rows:
                start, end = rank_slice(offset, global_batch=self.global_batch, dp_rank=self.dp_rank,
                                        dp_size=self.dp_size)
                table = self.reader.rows(order, start, end)
                yield epoch, preprocess(table, epoch) if preprocess else table
                offset += self.global_batch
            epoch, offset = epoch + 1, 0

    def __iter__(self) -> Iterator[StepBatch]:
        if self.prefetch == 0:
            yield from self._timed(iter(self._produce()))
            return
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def work():
            items = self._produce()
            try:
                for item in items:
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as e:   # hand reader errors to the training thread
                q.put(e)
            finally:
                items.close()            # stop the reader now (Ray Data's threads), not at garbage collection

        thread = threading.Thread(target=work, daemon=True, name="raydl-prefetch")
        thread.start()
        _PREFETCHERS.append((stop, thread))
        try:
            yield from self._timed(iter(q.get, None))
        finally:
            stop.set()
            thread.join(timeout=10)
            _PREFETCHERS.remove((stop, thread))

    def _timed(self, items) -> Iterator[StepBatch]:
        while True:
            t0 = time.perf_counter()
            item = next(items)
            if isinstance(item, BaseException):
                raise item
            item.wait_s = time.perf_counter() - t0
            self.ledger.record(item.position, item.tensors["id"])
            yield item


def eval_batches(info: DatasetInfo, *, batch: int, dp_rank: int, dp_size: int, max_batches: int,
                 max_bad_shards: int = 0) -> Iterator[dict]:
    """The first `max_batches` micro-batches of this rank's share of the eval split, in file order."""
    reader = SplitReader(info, "eval", seed=0, shuffle=False, max_bad_shards=max_bad_shards)
    order = reader.order(0)
    per_step = batch * dp_size
    for i in range(min(max_batches, order.num_rows // per_step)):
        start = i * per_step + dp_rank * batch
        yield to_tensors(reader.rows(order, start, start + batch), info.meta)
